//! `GgufWriter`: writes a GGUF v3 file from metadata and raw tensor bytes. The tests build
//! small files with it (every value type, odd alignments, truncations); it does no
//! quantization of its own: tensor bytes are given already encoded.

use std::path::Path;

use super::ggml_type::GgmlType;
use super::reader::{DEFAULT_ALIGNMENT, MAGIC};
use super::value::MetadataValue;

#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetadataValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(&mut self, key: &str, value: MetadataValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// A tensor of ggml dims `dims` (innermost first), its data already in `ty`'s layout.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// An f32 tensor of row-major `shape` (written with its dims reversed).
    pub fn f32_tensor(&mut self, name: &str, shape: &[usize], data: &[f32]) -> &mut Self {
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, &dims, GgmlType::F32, bytes)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self
            .metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT) as usize;
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend((value.value_type() as u32).to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            write_string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.code().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(alignment) * alignment;
        }
        let start = out.len().div_ceil(alignment) * alignment;
        out.resize(start, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            let end = (out.len() - start).div_ceil(alignment) * alignment + start;
            out.resize(end, 0);
        }
        out
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I8(v) => out.extend(v.to_le_bytes()),
        MetadataValue::U16(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I16(v) => out.extend(v.to_le_bytes()),
        MetadataValue::U32(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I32(v) => out.extend(v.to_le_bytes()),
        MetadataValue::F32(v) => out.extend(v.to_le_bytes()),
        MetadataValue::Bool(v) => out.push(u8::from(*v)),
        MetadataValue::String(s) => write_string(out, s),
        MetadataValue::U64(v) => out.extend(v.to_le_bytes()),
        MetadataValue::I64(v) => out.extend(v.to_le_bytes()),
        MetadataValue::F64(v) => out.extend(v.to_le_bytes()),
        MetadataValue::Array(items) => {
            // An empty array's item type is not recorded; u8 is as good as any.
            let ty = items
                .first()
                .map_or(super::value::ValueType::U8, MetadataValue::value_type);
            out.extend((ty as u32).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
    }
}
