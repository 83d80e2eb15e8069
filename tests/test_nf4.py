"""The NF4 format alone: the paper's table, exact packing, table · double-dequantized scale, refusal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RTOL_F32

from remat_kit.model import nf4

#: QLoRA's NF4 values as published (Dettmers et al. 2023, appendix E; bitsandbytes' NF4 map).
PAPER_TABLE = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def test_table_is_the_papers():
    assert nf4.TABLE.shape == (16,) and nf4.TABLE.dtype == np.float32
    assert nf4.TABLE.tolist() == PAPER_TABLE  # exactly: codes written elsewhere (bitsandbytes) mean the same
    np.testing.assert_allclose(nf4._table(), PAPER_TABLE, rtol=0, atol=1e-6)  # and so does the definition
    assert nf4.TABLE[7] == 0.0 and np.all(np.diff(nf4.TABLE) > 0)  # exact zero, ascending
    assert (nf4.TABLE > 0).sum() == 8 and (nf4.TABLE < 0).sum() == 7  # asymmetric


@pytest.mark.parametrize("shape", [(2,), (5, 8), (3, 4, 64)], ids=["pair", "2d", "3d"])
def test_pack_unpack_is_exact(shape):
    codes = jax.random.randint(jax.random.key(0), shape, 0, 16).astype(jnp.uint8)
    packed = nf4.pack(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    np.testing.assert_array_equal(np.asarray(nf4.unpack(packed)), np.asarray(codes))
    # Every byte value round-trips too: unpack is a bijection onto pairs of 4-bit codes.
    every = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(nf4.pack(nf4.unpack(every))), np.arange(256))


def test_encode_picks_the_nearest_table_value():
    x = jax.random.uniform(jax.random.key(1), (4096,), minval=-1, maxval=1)
    nearest = np.argmin(np.abs(np.asarray(x)[:, None] - nf4.TABLE[None, :]), axis=1)
    np.testing.assert_array_equal(np.asarray(nf4.encode(x)), nearest)
    np.testing.assert_array_equal(np.asarray(nf4.encode(jnp.asarray(nf4.TABLE))), np.arange(16))


# 64 x 8: 8 blocks (one padded 256-group); 3 x 128 x 256: per-layer kernels of 512 blocks (two groups each).
@pytest.mark.parametrize("shape", [(64, 8), (3, 128, 256)], ids=["padded-group", "stacked"])
def test_dequantize_is_table_times_double_dequantized_scale(shape):
    w = 0.02 * jax.random.normal(jax.random.key(2), shape)
    q = nf4.quantize(w)
    lead, blocks = shape[:-2], shape[-1] * shape[-2] // nf4.BLOCK
    assert q["codes"].dtype == jnp.uint8 and q["codes"].shape == (*shape[:-1], shape[-1] // 2)
    assert q["absmax_q"].dtype == jnp.int8 and q["absmax_q"].shape == (*lead, nf4.num_scales(shape))
    assert q["absmax_scale"].shape == (*lead, nf4.num_scales(shape) // nf4.SCALE_BLOCK)
    assert q["absmax_offset"].shape == (*lead, 1)
    # By hand, in numpy: codes from the bytes, scales from int8 * per-256 scale + the kernel's mean.
    packed = np.asarray(q["codes"]).reshape(*lead, -1)
    codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(*lead, blocks, nf4.BLOCK)
    s2 = np.repeat(np.asarray(q["absmax_scale"]), nf4.SCALE_BLOCK, axis=-1)
    scale = (np.asarray(q["absmax_q"], np.float32) * s2)[..., :blocks] + np.asarray(q["absmax_offset"])
    expect = (nf4.TABLE[codes] * scale[..., None]).reshape(shape)
    got = np.asarray(nf4.dequantize(q))
    np.testing.assert_allclose(got, expect, rtol=RTOL_F32, atol=0)
    # The double-dequantized scales are the blocks' absmax to within half an int8 step of the second level.
    absmax = np.abs(np.asarray(w)).reshape(*lead, blocks, nf4.BLOCK).max(-1)
    step = np.repeat(np.asarray(q["absmax_scale"]), nf4.SCALE_BLOCK, axis=-1)[..., :blocks]
    assert np.all(np.abs(np.asarray(nf4.scales(q)) - absmax) <= step / 2 * (1 + 1e-5))


def test_layers_are_quantized_independently():
    w = jax.random.normal(jax.random.key(3), (2, 64, 64)) * jnp.array([1.0, 100.0])[:, None, None]
    q = nf4.quantize(w)
    one = nf4.quantize(w[1])
    for name in nf4.LEAVES:
        np.testing.assert_array_equal(np.asarray(q[name][1]), np.asarray(one[name]))


def test_zero_block_and_exact_table_values_round_trip():
    w = np.zeros((64, 4), np.float32)
    w[:16, :] = nf4.TABLE.reshape(4, 4).repeat(4, 0) * 0.5  # first block(s): table values times 0.5
    got = np.asarray(nf4.dequantize(nf4.quantize(w)))
    assert np.all(got[16:] == 0)  # all-zero blocks stay exactly zero
    np.testing.assert_allclose(got, w, rtol=0, atol=0.5 * 2e-2)  # within the scale's int8 step


@pytest.mark.parametrize("shape", [(3, 5), (8, 7), (4,)], ids=["size-15", "odd-d_out", "1d"])
def test_unstorable_kernel_is_one_line_error(shape):
    with pytest.raises(ValueError, match=r"nf4 needs kernels whose size d_in\*d_out is a multiple of 64") as err:
        nf4.quantize(jnp.ones(shape))
    assert "\n" not in str(err.value)
