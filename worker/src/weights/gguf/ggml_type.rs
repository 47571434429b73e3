//! `GgmlType`: the tensor element types a GGUF file may hold (ggml's `ggml_type` codes),
//! with the block geometry of each: how many elements one block holds and in how many
//! bytes. Only the types `dequant` decodes are accepted by the loader.

/// Elements per super-block of the k-quants.
pub const QK_K: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
    /// A type this parser knows only by its code (the i-quants, ternary types, …).
    Other(u32),
}

impl GgmlType {
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            24 => Self::I8,
            25 => Self::I16,
            26 => Self::I32,
            27 => Self::I64,
            28 => Self::F64,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    pub fn code(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q8_1 => 9,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::I8 => 24,
            Self::I16 => 25,
            Self::I32 => 26,
            Self::I64 => 27,
            Self::F64 => 28,
            Self::BF16 => 30,
            Self::Other(c) => c,
        }
    }

    /// llama.cpp's name of the type ("Q4_K", "BF16", …).
    pub fn name(self) -> String {
        match self {
            Self::F32 => "F32".into(),
            Self::F16 => "F16".into(),
            Self::Q4_0 => "Q4_0".into(),
            Self::Q4_1 => "Q4_1".into(),
            Self::Q5_0 => "Q5_0".into(),
            Self::Q5_1 => "Q5_1".into(),
            Self::Q8_0 => "Q8_0".into(),
            Self::Q8_1 => "Q8_1".into(),
            Self::Q2K => "Q2_K".into(),
            Self::Q3K => "Q3_K".into(),
            Self::Q4K => "Q4_K".into(),
            Self::Q5K => "Q5_K".into(),
            Self::Q6K => "Q6_K".into(),
            Self::Q8K => "Q8_K".into(),
            Self::I8 => "I8".into(),
            Self::I16 => "I16".into(),
            Self::I32 => "I32".into(),
            Self::I64 => "I64".into(),
            Self::F64 => "F64".into(),
            Self::BF16 => "BF16".into(),
            Self::Other(c) => format!("ggml type {c}"),
        }
    }

    /// `(elements per block, bytes per block)`, or None for a type of unknown layout.
    pub fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            Self::F32 | Self::I32 => (1, 4),
            Self::F16 | Self::BF16 | Self::I16 => (1, 2),
            Self::I8 => (1, 1),
            Self::I64 | Self::F64 => (1, 8),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q8_1 => (32, 36),
            Self::Q2K => (QK_K, 84),
            Self::Q3K => (QK_K, 110),
            Self::Q4K => (QK_K, 144),
            Self::Q5K => (QK_K, 176),
            Self::Q6K => (QK_K, 210),
            Self::Q8K => (QK_K, 292),
            Self::Other(_) => return None,
        })
    }

    /// The types `dequant::dequantize` decodes to f32.
    pub const DEQUANTIZED: &'static [GgmlType] = &[
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    pub fn is_supported(self) -> bool {
        Self::DEQUANTIZED.contains(&self)
    }

    /// Bytes of `n` elements, or None when `n` is not a whole number of blocks or the
    /// layout is unknown.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let (elems, bytes) = self.block()?;
        n.is_multiple_of(elems).then(|| n / elems * bytes)
    }
}
