"""dtype fp8 on the host: the NumPy e4m3 twin against torch's float8_e4m3fn, row quantisation,
and the refusals (CPU backend, generation, models fp8 does not cover)."""

import numpy as np
import pytest

from ftengine import Encoder, Generator
from ftengine.backends import numpy_ops
from ftengine.config import load_bert_config
from ftengine.errors import ConfigError, DeviceError
from ftengine.models.bert import check_fp8
from tests.tolerances import E4M3_HALF_ULP, E4M3_SUBNORMAL_HALF_STEP
from weights.fixtures import write_gpt2_checkpoint, write_modernbert_checkpoint


def test_e4m3_conversions_match_torch(rng):
    import torch
    values = np.concatenate([rng.standard_normal(20000) * scale for scale in (1e-3, 0.02, 1, 40, 300)]
                            + [[0.0, -0.0, 448, -448, 464, 2 ** -9, 2 ** -10, 1.5 * 2 ** -9, 0.99 * 2 ** -6]])
    values = values.astype(np.float32)
    expected = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(numpy_ops.e4m3_bytes(values), expected)
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # 0x7F / 0xFF: NaN
    np.testing.assert_array_equal(numpy_ops.e4m3_values(finite),
                                  torch.from_numpy(finite).view(torch.float8_e4m3fn).float().numpy())


def test_e4m3_saturates_past_448():
    np.testing.assert_array_equal(numpy_ops.e4m3_values(numpy_ops.e4m3_bytes(np.float32([500, -1e9, 1e30]))),
                                  [448, -448, 448])


def test_quantize_rows_stands_for_each_row(rng):
    x = (rng.standard_normal((6, 96)) * np.float32([[1e-6], [1], [100], [3], [0], [1e4]])).astype(np.float32)
    q, scales = np.empty(x.shape, np.uint8), np.empty(6, np.float32)
    numpy_ops.quantize_rows(q, scales, x)
    amax = np.abs(x).max(1)
    np.testing.assert_allclose(scales, np.where(amax > 0, amax / 448, 1), rtol=1e-7)
    got = numpy_ops.e4m3_values(q) * scales[:, None]
    assert np.all(np.abs(got - x) <= E4M3_HALF_ULP * np.abs(x) + E4M3_SUBNORMAL_HALF_STEP * scales[:, None])
    np.testing.assert_array_equal(np.abs(numpy_ops.e4m3_values(q)).max(1), np.where(amax > 0, 448, 0))


def test_fp8_refused_on_the_cpu_and_for_generation(st_model, tmp_path):
    with pytest.raises(DeviceError, match="dtype fp8 needs the CUDA backend"):
        Encoder.from_pretrained(st_model, device="cpu", dtype="fp8")
    with pytest.raises(DeviceError, match="fp8 is for the encoders"):
        Generator.from_pretrained(write_gpt2_checkpoint(tmp_path / "gpt2", seed=1), device="cpu", dtype="fp8")
    with pytest.raises(DeviceError, match="the CPU \\(NumPy\\) backend computes in fp32"):
        numpy_ops.check_fp8()


def test_fp8_refuses_modernbert_and_odd_widths(tmp_path, st_model):
    modern = load_bert_config(write_modernbert_checkpoint(tmp_path / "modern", seed=1))
    with pytest.raises(ConfigError, match="ModernBERT runs in fp32, fp16 or bf16"):
        check_fp8(modern)
    with pytest.raises(ConfigError, match="divisible by 16"):
        check_fp8(load_bert_config(st_model))  # hidden 32, intermediate 37
