"""The README's commands, true as written: every `python -m flows.pretrain` command in its fenced
bash blocks plans (a dry run, as each is written, with the operator's folders the README tells the
reader to allow), and every cluster preset it names is shipped."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tasks.cluster.config import PRESET_DIR, load_cluster

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _commands() -> list[str]:
    """Each `flows.pretrain` command of the README's bash blocks, its continued lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if re.search(r"-m flows\.pretrain\b", line)]


def test_every_cluster_preset_the_readme_names_is_shipped():
    text = README.read_text()
    named = set(re.findall(r"--cluster ([\w.-]+)", text)) | set(re.findall(r'"preset": "([\w.-]+)"', text))
    shipped = {p.stem for p in PRESET_DIR.glob("*.yaml")}
    assert named and named <= shipped, f"the README names presets not shipped: {sorted(named - shipped)}"
    h100 = load_cluster("p5-8gpu")
    assert (h100.accelerator, h100.world_size, h100.price_per_node_hour is not None) == ("h100-80gb", 128, True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("command", _commands(), ids=lambda c: c[c.index("flows.pretrain"):][:60])
def test_each_readme_command_plans_as_written(command, tmp_path, monkeypatch, capsys):
    """The command line itself (flows.pretrain's main), in this process: a dry run needs no server."""
    from flows.cli import main
    from flows.pretrain import pretrain

    words = shlex.split(command)
    monkeypatch.setenv("GPT_INPUT_ROOTS", "/fsx:/data")
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):        # VARIABLE=value before the command
        monkeypatch.setenv(*words.pop(0).split("=", 1))
    monkeypatch.chdir(tmp_path)
    status = main(pretrain, [*words[words.index("flows.pretrain") + 1:], "--dry-run"])
    out = capsys.readouterr()
    assert status == 0, f"{command}\n{out.err[-3000:]}"
    assert "what happens: dry run" in out.out, out.out[-3000:]
