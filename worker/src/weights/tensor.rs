//! The weight types: `WeightTensor`, a tensor in its checkpoint dtype as raw little-endian
//! bytes (borrowed from an mmap until narrowed or fused), and `HostTensor`, f32 on the host.

use std::borrow::Cow;

use vllm_kernels::cuda::dtype::par_blocks;

use super::dummy::{self, DummyRegion};
use super::DType;

/// Bytes per block of the parallel copies that fuse weights.
const COPY_BLOCK: usize = 1 << 20;

/// A tensor on the host in f32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }

    /// Rows `start..start + len` along dimension 0 or 1 of a 1-D or 2-D tensor (the
    /// tensor-parallel shard of a weight).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> HostTensor {
        match (self.shape.len(), dim) {
            (_, 0) => {
                let row: usize = self.shape[1..].iter().product();
                let mut shape = self.shape.clone();
                shape[0] = len;
                HostTensor::new(shape, self.data[start * row..(start + len) * row].to_vec())
            }
            (2, 1) => {
                let (r, c) = (self.shape[0], self.shape[1]);
                let data = (0..r)
                    .flat_map(|i| {
                        self.data[i * c + start..i * c + start + len]
                            .iter()
                            .copied()
                    })
                    .collect();
                HostTensor::new(vec![r, len], data)
            }
            _ => panic!("narrow: unsupported dim {dim} of shape {:?}", self.shape),
        }
    }

    /// Concatenation along dimension 0 (fusing q/k/v or gate/up).
    pub fn cat_rows(parts: &[HostTensor]) -> HostTensor {
        let mut shape = parts[0].shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        HostTensor::new(
            shape,
            parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
        )
    }
}

/// A weight as little-endian bytes of `dtype`, row-major: borrowed from the checkpoint's
/// mmap where possible, owned once narrowed along columns or fused, or (dummy weights) not
/// drawn yet.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightTensor<'a> {
    pub shape: Vec<usize>,
    pub dtype: DType,
    data: WeightData<'a>,
}

#[derive(Debug, Clone, PartialEq)]
enum WeightData<'a> {
    Bytes(Cow<'a, [u8]>),
    /// Dummy values, drawn only when the bytes are asked for (or on the GPU by the CUDA
    /// backend): row blocks stacked in order.
    Dummy(Vec<DummyRegion>),
}

impl<'a> WeightTensor<'a> {
    pub fn new(shape: Vec<usize>, dtype: DType, bytes: Cow<'a, [u8]>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>() * dtype.size(), bytes.len());
        Self {
            shape,
            dtype,
            data: WeightData::Bytes(bytes),
        }
    }

    pub(super) fn dummy(shape: Vec<usize>, dtype: DType, regions: Vec<DummyRegion>) -> Self {
        Self {
            shape,
            dtype,
            data: WeightData::Dummy(regions),
        }
    }

    /// `t` encoded in `dtype` (tests, and f32 data that must go through `upload_weight`).
    pub fn from_host(t: &HostTensor, dtype: DType) -> WeightTensor<'static> {
        WeightTensor::new(t.shape.clone(), dtype, Cow::Owned(dtype.encode(&t.data)))
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The regions of a dummy weight not drawn yet, stacked by rows.
    pub fn dummy_regions(&self) -> Option<&[DummyRegion]> {
        match &self.data {
            WeightData::Dummy(regions) => Some(regions),
            WeightData::Bytes(_) => None,
        }
    }

    /// The raw bytes in `self.dtype` (a dummy weight is drawn now).
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        match &self.data {
            WeightData::Bytes(b) => Cow::Borrowed(b),
            WeightData::Dummy(regions) => Cow::Owned(dummy::draw(regions, self.dtype)),
        }
    }

    /// The values in f32 (converted in parallel chunks).
    pub fn to_f32(&self) -> Vec<f32> {
        self.dtype.decode(&self.bytes())
    }

    pub fn to_host(&self) -> HostTensor {
        HostTensor::new(self.shape.clone(), self.to_f32())
    }

    /// The bytes in `dtype`: these very bytes when the dtype is already `dtype`, else a
    /// parallel conversion.
    pub fn bytes_as(&self, dtype: DType) -> Cow<'_, [u8]> {
        let bytes = self.bytes();
        if self.dtype == dtype {
            bytes
        } else {
            Cow::Owned(self.dtype.convert(&bytes, dtype))
        }
    }

    /// Rows `start..start + len` along dimension 0 or 1 of a 1-D or 2-D tensor (the
    /// tensor-parallel shard of a weight), cut from the raw bytes. Along dimension 0 the
    /// shard of a borrowed tensor is still borrowed.
    pub fn narrow(self, dim: usize, start: usize, len: usize) -> WeightTensor<'a> {
        if let WeightData::Dummy(regions) = &self.data {
            let regions = dummy::narrow(regions, &self.shape, dim, start, len);
            let mut shape = self.shape;
            shape[dim] = len;
            return WeightTensor::dummy(shape, self.dtype, regions);
        }
        let es = self.dtype.size();
        match (self.shape.len(), dim) {
            (_, 0) => {
                assert!(
                    start + len <= self.shape[0],
                    "narrow: rows {start}..{} of shape {:?}",
                    start + len,
                    self.shape
                );
                if start == 0 && len == self.shape[0] {
                    return self;
                }
                let row: usize = self.shape[1..].iter().product::<usize>() * es;
                let mut shape = self.shape;
                shape[0] = len;
                let range = start * row..(start + len) * row;
                let bytes = match self.data {
                    WeightData::Bytes(Cow::Borrowed(b)) => Cow::Borrowed(&b[range]),
                    WeightData::Bytes(Cow::Owned(b)) => Cow::Owned(b[range].to_vec()),
                    WeightData::Dummy(_) => unreachable!("handled above"),
                };
                WeightTensor::new(shape, self.dtype, bytes)
            }
            (2, 1) => {
                let (r, c) = (self.shape[0], self.shape[1]);
                assert!(
                    start + len <= c,
                    "narrow: columns {start}..{} of shape {:?}",
                    start + len,
                    self.shape
                );
                if start == 0 && len == c {
                    return self;
                }
                let mut out = Vec::with_capacity(r * len * es);
                for row in self.bytes().chunks_exact(c * es) {
                    out.extend_from_slice(&row[start * es..(start + len) * es]);
                }
                WeightTensor::new(vec![r, len], self.dtype, Cow::Owned(out))
            }
            _ => panic!("narrow: unsupported dim {dim} of shape {:?}", self.shape),
        }
    }

    /// Concatenation along dimension 0 (fusing q/k/v or gate/up) of the raw bytes; parts
    /// of different dtypes (a mixed checkpoint) meet in f32. One part is returned as is.
    pub fn cat_rows(mut parts: Vec<WeightTensor<'a>>) -> WeightTensor<'a> {
        assert!(!parts.is_empty(), "cat_rows of no tensors");
        if parts.len() == 1 {
            return parts.pop().unwrap_or_else(|| unreachable!());
        }
        let mut shape = parts[0].shape.clone();
        assert!(
            parts.iter().all(|p| p.shape[1..] == shape[1..]),
            "cat_rows: mismatched shapes {:?}",
            parts.iter().map(|p| &p.shape).collect::<Vec<_>>()
        );
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        if parts.iter().all(|p| p.dtype == parts[0].dtype) {
            if let Some(regions) = parts
                .iter()
                .map(|p| p.dummy_regions().map(<[_]>::to_vec))
                .collect::<Option<Vec<_>>>()
            {
                return WeightTensor::dummy(shape, parts[0].dtype, regions.concat());
            }
        }
        let dtype = if parts.iter().all(|p| p.dtype == parts[0].dtype) {
            parts[0].dtype
        } else {
            DType::F32
        };
        let total = parts.iter().map(|p| p.numel()).sum::<usize>() * dtype.size();
        // Zeroed pages are mapped lazily, so the parallel copy also spreads the faults.
        let mut out = vec![0u8; total];
        let mut rest = out.as_mut_slice();
        for p in &parts {
            let src = p.bytes_as(dtype);
            let (dst, tail) = rest.split_at_mut(src.len());
            par_blocks(dst, COPY_BLOCK, |i, d| {
                d.copy_from_slice(&src[i * COPY_BLOCK..i * COPY_BLOCK + d.len()])
            });
            rest = tail;
        }
        WeightTensor::new(shape, dtype, Cow::Owned(out))
    }
}
