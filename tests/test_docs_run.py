"""The README's code runs as pasted: its Python program, its vLLM quick start (with
``vllm`` stood in for by a stub that prints what it was given), and the model maker's
``--help`` that the docs point to."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def test_every_python_block_of_the_readme_runs_as_pasted(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    assert blocks
    for index, block in enumerate(blocks):
        program = tmp_path / f"block{index}.py"
        program.write_text(block)
        result = subprocess.run([sys.executable, str(program)], cwd=tmp_path, env=_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"README's python block {index}:\n{result.stderr}"
    assert "ok: 192 of 192 tokens loaded after the restart" in result.stdout


def _quick_start() -> str:
    section = README.split("## Quick start with vLLM", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```\n(.*?)```", section, flags=re.DOTALL)
    return block


def test_the_quick_start_runs_and_hands_vllm_the_stack(tmp_path: Path) -> None:
    block = _quick_start()
    assert block.index("vllm serve") > block.index("kvtiers check")
    root = tmp_path / "nvme"
    script = block.replace("/mnt/nvme/kvtiers", str(root))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvtiers").write_text(f'#!/bin/sh\nexec {sys.executable} -m kvtiers "$@"\n')
    (bin_dir / "vllm").write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; "
        "print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    result = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120,
                            env=_env(PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "stack.yaml: ok — ready to start"
    args = json.loads(lines[-1])
    assert args[:5] == ["serve", "MODEL", "--enable-prefix-caching", "--shutdown-timeout", "60"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVTiersConnector"
    assert config["kv_connector_extra_config"]["kvtiers_config"] == str(tmp_path / "stack.yaml")
    assert not root.exists(), "kvtiers check created the root"


def test_the_model_maker_is_a_documented_command() -> None:
    result = subprocess.run([sys.executable, "-m", "kvtiers.testing.models", "--help"],
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m kvtiers.testing.models")
    assert "--layers N" in result.stdout and "DIR" in result.stdout
