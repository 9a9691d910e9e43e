"""lla.runtime's matmul precision: resolution per backend, CPU left exactly as it was."""

import jax
import pytest

from lla import runtime


def test_resolution_per_backend():
  assert runtime.resolve_matmul_precision("auto", "cpu") == "float32"
  assert runtime.resolve_matmul_precision("auto", "gpu") == runtime.ACCELERATOR_PRECISION
  assert runtime.resolve_matmul_precision("auto", "tpu") == "tensorfloat32"
  assert runtime.resolve_matmul_precision("bfloat16", "gpu") == "bfloat16"
  with pytest.raises(ValueError, match="XLA:CPU multiplies float32 in float32"):
    runtime.resolve_matmul_precision("bfloat16", "cpu")
  with pytest.raises(ValueError, match="must be auto or one of"):
    runtime.resolve_matmul_precision("fp16", "gpu")


def test_cpu_keeps_jax_default_and_records_float32(monkeypatch):
  assert jax.default_backend() == "cpu"
  monkeypatch.setenv(runtime.PRECISION_ENV_VAR, "float32")
  assert runtime.configure_matmul_precision() == "float32"
  assert jax.config.jax_default_matmul_precision is None
  assert runtime.precision_record() == {"matmul_precision": "float32",
                                        "jax_default_matmul_precision": None, "backend": "cpu"}
  monkeypatch.setenv(runtime.PRECISION_ENV_VAR, "tensorfloat32")
  with pytest.raises(ValueError, match="LLA_MATMUL_PRECISION=tensorfloat32"):
    runtime.configure_matmul_precision()
  with jax.default_matmul_precision("tensorfloat32"):
    assert runtime.precision_record()["matmul_precision"] == "tensorfloat32"
