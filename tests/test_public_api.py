"""The public API: every name ``kvtiers`` exports resolves lazily, the example program runs,
and the README's Python snippet is that program."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtiers
from kvtiers.config import load_stack_config
from kvtiers.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "store_restart_load.py"


@pytest.mark.parametrize("name", [n for n in kvtiers.__all__ if n != "__version__"])
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(kvtiers, name) is not None
    assert name in dir(kvtiers)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kvtiers.Nope  # noqa: B018


def test_the_example_stores_restarts_and_loads(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "cache")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok: 192 of 192 tokens loaded after the restart, bytes identical\n"


def _program(text: str) -> str:
    """The example's program: from its first plain import to its end (the docstring and
    ``from __future__`` left out)."""
    return text[text.index("import sys\n"):].strip()


def test_the_readme_snippet_is_the_example() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert _program(EXAMPLE.read_text()) in [block.strip() for block in blocks], (
        "README's Python snippet differs from examples/store_restart_load.py; paste the "
        "example's program (from `import sys` to its end) into README.md"
    )


def test_a_layer_dict_becomes_kv_cache_tensors() -> None:
    stack = load_stack_config({"tiers": [{"kind": "cpu", "capacity": "1MiB"}],
                               "model": {"name": "m", "groups": [
                                   {"tokens_per_block": 16, "num_layers": 2,
                                    "page_bytes": "1KiB"}]}})
    assert stack.model is not None
    identity = stack.model.to_offloading_config()
    layers = {f"g0.layer{j}": torch.zeros(8, 2, 256, dtype=torch.float16) for j in range(2)}
    kv = kvtiers.KVCacheTensors.from_layers(layers, identity)
    assert [tuple(t.shape) for t in kv.tensors] == [(8, 1024), (8, 1024)]
    assert kv.group_bytes_per_block(0) == 2048
    with pytest.raises(ConfigError, match=r"no KV tensor for layer 'g0\.layer1'"):
        kvtiers.KVCacheTensors.from_layers({"g0.layer0": layers["g0.layer0"]}, identity)
    with pytest.raises(ConfigError, match="holds 512 bytes per block; group 0 needs 1024"):
        kvtiers.KVCacheTensors.from_layers(
            {name: torch.zeros(8, 256, dtype=torch.float16) for name in layers}, identity)
    with pytest.raises(ConfigError, match="cannot be viewed as"):
        kvtiers.KVCacheTensors.from_layers(
            {name: t.transpose(1, 2) for name, t in layers.items()}, identity)
