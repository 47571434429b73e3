//! The GGUF v2/v3 layout parser: header, metadata key/values, tensor infos, alignment and
//! the start of the tensor data, read from a byte slice (the mmap) with a bounds-checked
//! cursor, so a bad or truncated file is an error that says where, never a panic.

use std::collections::HashMap;

use super::ggml_type::GgmlType;
use super::value::{MetadataValue, ValueType};

/// "GGUF" read as a little-endian u32.
pub const MAGIC: u32 = 0x4655_4747;
/// The tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Arrays and strings longer than this are taken for corruption, not allocated.
const MAX_LEN: u64 = 1 << 32;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (magic {0:#010x}, expected \"GGUF\")")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error(
        "GGUF file truncated: {what} at byte {offset} needs {needed} bytes, the file has {len}"
    )]
    Truncated {
        what: String,
        offset: usize,
        needed: usize,
        len: usize,
    },
    #[error("GGUF metadata `{key}`: unknown value type {code}")]
    BadValueType { key: String, code: u32 },
    #[error("GGUF metadata `{key}`: length {len} is implausible")]
    BadLength { key: String, len: u64 },
    #[error("GGUF: general.alignment {0} is not a power of two")]
    BadAlignment(u64),
    #[error("GGUF tensor `{name}`: {problem}")]
    BadTensor { name: String, problem: String },
}

/// Where and what one tensor is. `dims` are ggml's `ne`, innermost first (`dims[0]` is the
/// number of columns); `offset` counts from the start of the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    pub offset: u64,
}

impl TensorInfo {
    /// The shape in row-major (PyTorch, Hugging Face) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// Everything before the tensor data.
#[derive(Debug)]
pub struct Layout {
    pub version: u32,
    /// Keys in file order, for listing.
    pub keys: Vec<String>,
    pub metadata: HashMap<String, MetadataValue>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Byte offset of the tensor data in the file.
    pub data_offset: usize,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        match self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
        {
            Some(end) => {
                let out = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(GgufError::Truncated {
                what: what(),
                offset: self.pos,
                needed: n,
                len: self.bytes.len(),
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > MAX_LEN {
            return Err(GgufError::BadLength { key: what(), len });
        }
        let bytes = self.take(len as usize, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: ValueType, key: &str) -> Result<MetadataValue, GgufError> {
        let what = &|| format!("metadata `{key}`");
        Ok(match ty {
            ValueType::U8 => MetadataValue::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => MetadataValue::U32(self.u32(what)?),
            ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::Bool => MetadataValue::Bool(self.array::<1>(what)?[0] != 0),
            ValueType::String => MetadataValue::String(self.string(what)?),
            ValueType::U64 => MetadataValue::U64(self.u64(what)?),
            ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Array => {
                let code = self.u32(what)?;
                let item = ValueType::from_code(code).ok_or_else(|| GgufError::BadValueType {
                    key: key.to_string(),
                    code,
                })?;
                let len = self.u64(what)?;
                // Each item takes at least one byte, so a longer array cannot fit the file.
                if len > MAX_LEN || len as usize > self.bytes.len() - self.pos {
                    return Err(GgufError::BadLength {
                        key: key.to_string(),
                        len,
                    });
                }
                let items = (0..len)
                    .map(|_| self.value(item, key))
                    .collect::<Result<Vec<_>, _>>()?;
                MetadataValue::Array(items)
            }
        })
    }
}

/// Parses everything up to the tensor data and checks that every tensor lies inside the
/// file.
pub fn parse(bytes: &[u8]) -> Result<Layout, GgufError> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.u32(&|| "the magic".into())?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "the tensor count".into())?;
    let n_kv = c.u64(&|| "the metadata count".into())?;

    let mut keys = Vec::new();
    let mut metadata = HashMap::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key {i}"))?;
        let code = c.u32(&|| format!("metadata `{key}`"))?;
        let ty = ValueType::from_code(code).ok_or_else(|| GgufError::BadValueType {
            key: key.clone(),
            code,
        })?;
        let value = c.value(ty, &key)?;
        keys.push(key.clone());
        metadata.insert(key, value);
    }

    let mut tensors = Vec::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor info {i}"))?;
        let what = &|| format!("tensor info `{name}`");
        let n_dims = c.u32(what)?;
        if n_dims > 4 {
            return Err(GgufError::BadTensor {
                name,
                problem: format!("{n_dims} dimensions (at most 4)"),
            });
        }
        let dims = (0..n_dims)
            .map(|_| c.u64(what))
            .collect::<Result<Vec<_>, _>>()?;
        let ggml_type = GgmlType::from_code(c.u32(what)?);
        let offset = c.u64(what)?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v.as_u64().unwrap_or(0),
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment(alignment));
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        let bad = |problem: String| GgufError::BadTensor {
            name: t.name.clone(),
            problem,
        };
        if t.offset % alignment != 0 {
            return Err(bad(format!(
                "offset {} is not a multiple of the alignment {alignment}",
                t.offset
            )));
        }
        let numel = t
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("dimensions {:?} overflow", t.dims)))?;
        // Unknown layouts are reported when the tensor is read, so a file with one exotic
        // tensor still lists its others.
        let Some((elems, block_bytes)) = t.ggml_type.block() else {
            continue;
        };
        if numel % elems as u64 != 0 {
            return Err(bad(format!(
                "{numel} elements are not whole {} blocks of {elems}",
                t.ggml_type.name()
            )));
        }
        let size = numel / elems as u64 * block_bytes as u64;
        if t.offset.checked_add(size).is_none_or(|end| end > data_len) {
            return Err(GgufError::Truncated {
                what: format!("tensor `{}` data", t.name),
                offset: (data_offset + t.offset) as usize,
                needed: size as usize,
                len: bytes.len(),
            });
        }
    }
    Ok(Layout {
        version,
        keys,
        metadata,
        tensors,
        alignment,
        data_offset: data_offset as usize,
    })
}
