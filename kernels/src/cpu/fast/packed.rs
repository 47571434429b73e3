//! `PackedMatrix`: a weight in the layout the fast GEMM reads, packed once at load time.
//!
//! A linear layer's weight `W` [n, k] (PyTorch's [out, in]) is cut into panels of
//! `PANEL` = 16 output rows; panel `p` stores, for each `c` in `0..k`, the 16 values
//! `W[16p..16p + 16][c]` side by side (the last panel padded with zero rows). A GEMV then
//! reads every weight once, in order, and one vector load gives 16 outputs' next term, so
//! no horizontal sum is ever needed. Elements stay in the checkpoint's or `--dtype`'s
//! precision (f32, bf16 or f16) and are widened to f32 in registers.
//!
//! bf16 weights are multiplied by bf16-rounded inputs, as the `vdpbf16ps` instruction does:
//! each pair of columns `(2c, 2c + 1)` is taken odd one first (`Bf16Layout`), and the
//! matrix is padded to an even number of columns.

use half::{bf16, f16};

use crate::cuda::dtype::par_blocks;
use crate::cuda::DType;

/// Output rows per panel: one AVX-512 vector of f32.
pub const PANEL: usize = 16;

/// An element type a weight can be stored in; widening to f32 is exact.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum PackedData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// Where a bf16 panel keeps the element of column `c`, lane `l`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Layout {
    /// `[c ^ 1][l]`: the columns of each pair swapped, for kernels that take the columns
    /// in order.
    Swapped,
    /// `[c / 2][l][c % 2]`: each lane's pair side by side, as `vdpbf16ps` reads them.
    Pairs,
}

impl Bf16Layout {
    #[inline(always)]
    fn pos(self, c: usize, l: usize) -> usize {
        match self {
            Bf16Layout::Swapped => (c ^ 1) * PANEL + l,
            Bf16Layout::Pairs => (c / 2) * 2 * PANEL + 2 * l + c % 2,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    data: PackedData,
    /// How bf16 data is laid out (unused for f32 and f16).
    layout: Bf16Layout,
}

/// Elements of each parallel packing block: whole panels of about 1 MiB.
fn block_elems(cols: usize) -> usize {
    let panel = (PANEL * cols).max(1);
    panel * (((1 << 18) / panel).max(1))
}

/// Packs `rows` × `cols` row-major values, produced a row at a time by `read_row(r, dst)`,
/// into panels of `width` ≥ `cols` columns, element (c, l) of a panel at `pos(c, l)`.
fn pack<T: Elem>(
    rows: usize,
    cols: usize,
    width: usize,
    pos: impl Fn(usize, usize) -> usize + Sync,
    read_row: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let panels = rows.div_ceil(PANEL);
    let mut out = vec![T::default(); panels * PANEL * width];
    if cols == 0 {
        return out;
    }
    let per_block = block_elems(width);
    par_blocks(&mut out, per_block, |b, dst| {
        let mut row = vec![T::default(); cols];
        let first_panel = b * per_block / (PANEL * width);
        for (i, panel) in dst.chunks_exact_mut(PANEL * width).enumerate() {
            let p = first_panel + i;
            for l in 0..PANEL.min(rows.saturating_sub(p * PANEL)) {
                read_row(p * PANEL + l, &mut row);
                for (c, &v) in row.iter().enumerate() {
                    panel[pos(c, l)] = v;
                }
            }
        }
    });
    out
}

fn seq(c: usize, l: usize) -> usize {
    c * PANEL + l
}

fn le_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

impl PackedMatrix {
    /// Packs the row-major f32 matrix `w` [rows, cols], stored as f32.
    pub fn from_f32(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "PackedMatrix: shape");
        let data = pack(rows, cols, cols, seq, |r, dst: &mut [f32]| {
            dst.copy_from_slice(&w[r * cols..(r + 1) * cols])
        });
        Self {
            rows,
            cols,
            data: PackedData::F32(data),
            layout: Bf16Layout::Swapped,
        }
    }

    /// Packs `bytes`, the little-endian row-major [rows, cols] matrix in `from`, stored in
    /// `to` (rounded to nearest even when `to` is narrower); bf16 in `layout`.
    pub fn from_le_bytes(
        bytes: &[u8],
        from: DType,
        to: DType,
        rows: usize,
        cols: usize,
        layout: Bf16Layout,
    ) -> Self {
        let es = from.size();
        assert_eq!(bytes.len(), rows * cols * es, "PackedMatrix: shape");
        let row_bytes = |r: usize| &bytes[r * cols * es..(r + 1) * cols * es];
        let row_f32 = |r: usize| {
            let mut v = vec![0f32; cols];
            from.decode_into(row_bytes(r), &mut v);
            v
        };
        let even = cols + cols % 2;
        let bf16_pos = move |c, l| layout.pos(c, l);
        let data = match (from, to) {
            (DType::BF16, DType::BF16) => {
                PackedData::BF16(pack(rows, cols, even, bf16_pos, |r, dst| {
                    for (d, b) in dst.iter_mut().zip(row_bytes(r).chunks_exact(2)) {
                        *d = bf16::from_bits(le_u16(b));
                    }
                }))
            }
            (_, DType::BF16) => PackedData::BF16(pack(rows, cols, even, bf16_pos, |r, dst| {
                for (d, v) in dst.iter_mut().zip(row_f32(r)) {
                    *d = bf16::from_f32(v);
                }
            })),
            (DType::F16, DType::F16) => PackedData::F16(pack(rows, cols, cols, seq, |r, dst| {
                for (d, b) in dst.iter_mut().zip(row_bytes(r).chunks_exact(2)) {
                    *d = f16::from_bits(le_u16(b));
                }
            })),
            (_, DType::F16) => PackedData::F16(pack(rows, cols, cols, seq, |r, dst| {
                for (d, v) in dst.iter_mut().zip(row_f32(r)) {
                    *d = f16::from_f32(v);
                }
            })),
            (_, DType::F32) => PackedData::F32(pack(rows, cols, cols, seq, |r, dst| {
                from.decode_into(row_bytes(r), dst)
            })),
        };
        Self {
            rows,
            cols,
            data,
            layout,
        }
    }

    /// Columns a panel stores: `cols`, rounded up to even for bf16.
    pub fn width(&self) -> usize {
        match self.data {
            PackedData::BF16(_) => self.cols + self.cols % 2,
            _ => self.cols,
        }
    }

    pub fn bf16_layout(&self) -> Bf16Layout {
        self.layout
    }

    /// Output rows (`n`).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input columns (`k`).
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }
    pub fn dtype(&self) -> DType {
        match self.data {
            PackedData::F32(_) => DType::F32,
            PackedData::BF16(_) => DType::BF16,
            PackedData::F16(_) => DType::F16,
        }
    }
    pub fn data(&self) -> &PackedData {
        &self.data
    }
    /// Bytes of memory the packed values take.
    pub fn bytes(&self) -> usize {
        self.panels() * PANEL * self.width() * self.dtype().size()
    }

    /// Row `r` in f32 (an embedding lookup).
    pub fn row_into(&self, r: usize, dst: &mut [f32]) {
        assert!(r < self.rows, "PackedMatrix: row {r} of {}", self.rows);
        assert_eq!(dst.len(), self.cols, "PackedMatrix: row width");
        fn gather<T: Elem>(
            v: &[T],
            r: usize,
            width: usize,
            pos: impl Fn(usize, usize) -> usize,
            dst: &mut [f32],
        ) {
            let panel = &v[r / PANEL * PANEL * width..][..PANEL * width];
            for (c, d) in dst.iter_mut().enumerate() {
                *d = panel[pos(c, r % PANEL)].to_f32();
            }
        }
        let width = self.width();
        match &self.data {
            PackedData::F32(v) => gather(v, r, width, seq, dst),
            PackedData::BF16(v) => gather(v, r, width, |c, l| self.layout.pos(c, l), dst),
            PackedData::F16(v) => gather(v, r, width, seq, dst),
        }
    }

    /// The whole matrix, row-major, in f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
                self.row_into(r, row);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_panels_and_unpacks_rows() {
        let (rows, cols) = (37, 5);
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32 - 20.5).collect();
        let p = PackedMatrix::from_f32(&w, rows, cols);
        assert_eq!(p.panels(), 3);
        let PackedData::F32(v) = p.data() else {
            panic!("f32")
        };
        assert_eq!(v.len(), 3 * PANEL * cols);
        // Panel 1, column 2, lane 3 is W[19][2]; padding rows are zero.
        assert_eq!(v[PANEL * cols + 2 * PANEL + 3], w[19 * cols + 2]);
        assert_eq!(v[2 * PANEL * cols + 4 * PANEL + 15], 0.0);
        assert_eq!(p.to_f32(), w);
    }

    #[test]
    fn converts_between_dtypes_like_dtype_encode() {
        let (rows, cols) = (20, 3); // an odd width: bf16 pads a column
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32).sin() * 3.3).collect();
        let f32_bytes = DType::F32.encode(&w);
        for to in [DType::BF16, DType::F16, DType::F32] {
            for layout in [Bf16Layout::Swapped, Bf16Layout::Pairs] {
                let p = PackedMatrix::from_le_bytes(&f32_bytes, DType::F32, to, rows, cols, layout);
                let want: Vec<f32> = w.iter().map(|&v| to.round(v)).collect();
                assert_eq!(p.to_f32(), want, "{to:?}");
                assert_eq!(p.dtype(), to);
                // From the narrow dtype's own bytes: the same values.
                let q = PackedMatrix::from_le_bytes(&to.encode(&w), to, to, rows, cols, layout);
                assert_eq!(q, p);
            }
        }
    }
}
