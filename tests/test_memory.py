"""The one host-offload rule and XLA's compiled memory (remat_kit.analysis.memory)."""

import jax
import jax.numpy as jnp

from remat_kit import _jax_internals
from remat_kit.analysis import inspection, memory


def test_cpu_does_not_enforce_host_offload_and_says_so():
    rule = memory.host_offload(jax.devices("cpu")[0])
    assert rule.platform == "cpu" and rule.enforced is False
    assert "does not enforce host offload" in rule.note and "(cpu)" in rule.note


def test_offload_is_available_only_where_jax_can_offload_to_a_host_memory_kind(monkeypatch):
    rule = memory.host_offload()
    assert rule.host_memory == any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())
    assert rule.available == (rule.host_memory and _jax_internals.offload_supported())
    monkeypatch.setattr(_jax_internals, "offload_supported", lambda: False)  # jax 0.10's remat3
    assert not rule.remat_offloads and not rule.available


def test_inspection_asks_the_one_rule():
    report = inspection.inspect(lambda x: jnp.sum(jnp.sin(x) ** 2), jnp.ones(8))
    assert report.host_offload_enforced == memory.host_offload().enforced
    assert inspection.CompiledMemory is memory.CompiledMemory


def test_compiled_memory_reads_xlas_buffer_assignment():
    compiled = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((64, 64), jnp.float32)).compile()
    m = memory.CompiledMemory.from_compiled(compiled)
    assert m.argument == m.output == 64 * 64 * 4 and m.alias == 0
    assert m.total == m.argument + m.output + m.temp and m.host == 0
