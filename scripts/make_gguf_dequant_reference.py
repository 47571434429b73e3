"""Writes worker/tests/data/gguf_dequant_reference.gguf: for each quantized type a tensor of
random blocks (scales set to sane f16 values) and, beside it, `<name>.expected`: the same
values dequantized by the `gguf` package (gguf.quants.dequantize), as F32. Also a few
metadata keys of every value type, so the Rust parser is checked against gguf's writer.
Run once; the Rust tests read the committed file and need no Python."""
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

rng = np.random.default_rng(7)
w = gguf.GGUFWriter("worker/tests/data/gguf_dequant_reference.gguf", "llama")
w.add_uint8("test.u8", 200)
w.add_int8("test.i8", -5)
w.add_uint16("test.u16", 60000)
w.add_int16("test.i16", -30000)
w.add_uint32("test.u32", 4000000000)
w.add_int32("test.i32", -2000000000)
w.add_float32("test.f32", 1.5)
w.add_bool("test.bool", True)
w.add_string("test.string", "héllo ✓")
w.add_uint64("test.u64", 1 << 40)
w.add_int64("test.i64", -(1 << 40))
w.add_float64("test.f64", 2.25)
w.add_array("test.array_str", ["a", "bc", ""])
w.add_array("test.array_i32", [1, -2, 3])

def f16_bytes(n):
    return rng.uniform(-0.05, 0.05, n).astype(np.float16).view(np.uint8)

# (type, blocks, byte offsets of f16 fields within a block)
layouts = {
    T.Q8_0: (4, [0]),
    T.Q4_0: (4, [0]),
    T.Q4_1: (4, [0, 2]),
    T.Q4_K: (2, [0, 2]),
    T.Q5_K: (2, [0, 2]),
    T.Q6_K: (2, [208]),
}
for ty, (blocks, f16_fields) in layouts.items():
    elems, size = gguf.GGML_QUANT_SIZES[ty]
    raw = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    for off in f16_fields:
        raw[:, off:off + 2] = f16_bytes(blocks).reshape(blocks, 2)
    ref = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
    n = elems * blocks
    name = ty.name.lower()
    # 2 rows of n/2 columns (gguf takes the numpy shape of quantized data in bytes).
    w.add_tensor(name, raw.reshape(2, -1), raw_dtype=ty)
    w.add_tensor(name + ".expected", ref.reshape(2, n // 2))
for ty in (T.F16, T.BF16):
    vals = rng.standard_normal(64).astype(np.float32)
    if ty == T.F16:
        raw = vals.astype(np.float16).view(np.uint8)
    else:
        raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    ref = dequantize(raw, ty).astype(np.float32)
    w.add_tensor(ty.name.lower(), raw.reshape(4, 32), raw_dtype=ty)
    w.add_tensor(ty.name.lower() + ".expected", ref.reshape(4, 16))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
