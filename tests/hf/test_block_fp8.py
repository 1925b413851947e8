"""Block-scaled FP8 weights: widened to float32 exactly, and written back as the same bytes
when nothing changed them; fresh weights get the amax / 448 scale of each block."""

import ml_dtypes
import numpy as np
import pytest

from jaxmoe.hf.block_fp8 import E4M3_MAX, FP8, dequantize, quantize, scale_shape

BLOCK = (16, 16)


def test_the_scales_cover_partial_blocks():
    assert scale_shape((40, 24), BLOCK) == (3, 2)
    assert scale_shape((576, 7168), (128, 128)) == (5, 56)  # DeepSeek-V3's kv_a_proj


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_a_dequantized_weight_quantizes_back_to_the_same_bytes(magnitude):
    rng = np.random.default_rng(0)
    values = np.clip(rng.standard_normal((40, 24)) * 100, -400, 400).astype(FP8)
    values[::16, ::16] = FP8(-E4M3_MAX)  # each block's largest, as quantizers leave it
    scale = (rng.uniform(0.5, 2, scale_shape(values.shape, BLOCK)) * magnitude / 448).astype(
        np.float32
    )

    weight = dequantize(values, scale, BLOCK)
    again, scale_again = quantize(weight, BLOCK)

    assert weight.dtype == np.float32
    assert again.dtype == ml_dtypes.float8_e4m3fn and again.shape == values.shape
    assert again.tobytes() == values.tobytes() and scale_again.tobytes() == scale.tobytes()


def test_a_fresh_weight_gets_the_amax_scale_of_each_block():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((40, 24)).astype(np.float32)
    weight[20:, :] *= 50  # blocks of other magnitudes

    values, scale = quantize(weight, BLOCK)

    amax = np.abs(weight[:16, :16]).max()
    assert scale[0, 0] == pytest.approx(amax / E4M3_MAX, rel=1e-6)
    assert np.abs(values.astype(np.float32)).max() == E4M3_MAX
    error = np.abs(dequantize(values, scale, BLOCK) - weight) / np.abs(weight).max()
    assert error.max() < 2**-3  # e4m3's 3 mantissa bits, relative to the block's largest
    assert np.array_equal(quantize(dequantize(values, scale, BLOCK), BLOCK)[1], scale)


def test_power_of_two_scales_are_kept_powers_of_two_and_read_back_the_same():
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((40, 24)).astype(np.float32) * 3

    values, scale = quantize(weight, BLOCK, power_of_two=True)

    assert np.all(np.exp2(np.round(np.log2(scale))) == scale)
    assert np.all(scale >= np.abs(weight[:16, :16]).max() / E4M3_MAX)
    # Read and written again: the same weights (a block whose largest value rounded down to
    # 224 may come back as twice its values at half its scale).
    widened = dequantize(values, scale, BLOCK)
    again, scale_again = quantize(widened, BLOCK, power_of_two=True)
    assert np.array_equal(dequantize(again, scale_again, BLOCK), widened)
