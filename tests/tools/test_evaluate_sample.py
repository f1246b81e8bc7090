"""``tools evaluate`` and ``tools sample`` on tiny exports written here: a folder whose config.json does not
agree with its weights, or whose weights file is damaged, is refused in one line (exit 2) before a model is
built; sample keeps to the model's positions and refuses what it cannot use."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from callbacks.export import export_model
from model.hf import WEIGHTS_NAME
from model.decoder import ModelConfig
from model.families import build_model
from tests.helpers import records
from tools import evaluate, sample

ROOT = Path(__file__).resolve().parents[2]
POSITIONS = 16


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    found = {}
    for name, family, qk_norm in (("gpt2", "gpt2", False), ("llama", "llama", False), ("qwen3", "llama", True)):
        model = build_model(ModelConfig(family=family, vocab_size=8192, n_layer=2, n_head=2, n_embd=16,
                                        max_seq_len=POSITIONS, qk_norm=qk_norm))
        export_model(model, ROOT / "conf" / "tokenizer.json", root / name)
        found[name] = root / name
    data = root / "data.jsonl"
    data.write_bytes(records(20))
    found["data"] = data
    return found


def copy_of(folder: Path, to: Path) -> Path:
    to.mkdir()
    for path in folder.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def with_config(folder: Path, to: Path, **changes) -> Path:
    copy = copy_of(folder, to)
    config = json.loads((copy / "config.json").read_text()) | changes
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def relabelled(folder: Path, to: Path, old: str, new: str) -> Path:
    """The weights' header with every dtype ``old`` named ``new`` (same width: the file stays consistent)."""
    copy = copy_of(folder, to)
    data = (copy / WEIGHTS_NAME).read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + size].replace(f'"{old}"'.encode(), f'"{new}"'.encode())
    (copy / WEIGHTS_NAME).write_bytes(data[:8] + header + data[8 + size:])
    return copy


def truncated(folder: Path, to: Path) -> Path:
    copy = copy_of(folder, to)
    data = (copy / WEIGHTS_NAME).read_bytes()
    (copy / WEIGHTS_NAME).write_bytes(data[:len(data) // 2])
    return copy


def bad_header(folder: Path, to: Path) -> Path:
    copy = copy_of(folder, to)
    data = (copy / WEIGHTS_NAME).read_bytes()
    (copy / WEIGHTS_NAME).write_bytes(struct.pack("<Q", 2**40) + data[8:])
    return copy


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


BAD_FOLDERS = {
    "100000 layers": ("gpt2", lambda f, to: with_config(f, to, n_layer=100_000), "n_layer"),
    "a vocabulary of 10**12": ("gpt2", lambda f, to: with_config(f, to, vocab_size=10**12), "transformer.wte.weight"),
    "positions that are not the tensor's": ("gpt2", lambda f, to: with_config(f, to, n_positions=10**9), "wpe"),
    "a width that is text": ("gpt2", lambda f, to: with_config(f, to, n_embd="16"), "n_embd"),
    "llama layers": ("llama", lambda f, to: with_config(f, to, num_hidden_layers=10**12), "num_hidden_layers"),
    "rope_theta NaN": ("llama", lambda f, to: with_config(f, to, rope_theta=math.nan), "rope_theta"),
    "llama positions of 10**12": ("llama", lambda f, to: with_config(f, to, max_position_embeddings=10**12),
                                  "max_position_embeddings"),
    "a llama named qwen3": ("llama", lambda f, to: with_config(f, to, model_type="qwen3"), "self_attn.q_norm.weight"),
    "weights relabelled I32": ("gpt2", lambda f, to: relabelled(f, to, "F32", "I32"), "I32"),
    "a truncated weights file": ("gpt2", truncated, WEIGHTS_NAME),
    "a header size past the file": ("llama", bad_header, WEIGHTS_NAME),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_evaluate_refuses_a_folder_whose_config_or_weights_do_not_agree(exports, tmp_path, capsys, case):
    family, make, named = BAD_FOLDERS[case]
    folder = make(exports[family], tmp_path / "model")
    assert evaluate.main([str(folder), "--data", str(exports["data"]), "--device", "cpu"]) == 2
    assert named in one_error_line(capsys)


@pytest.mark.parametrize("case", ["100000 layers", "weights relabelled I32", "a truncated weights file"])
def test_sample_refuses_the_same_folders_before_loading(exports, tmp_path, capsys, case):
    family, make, named = BAD_FOLDERS[case]
    folder = make(exports[family], tmp_path / "model")
    assert sample.main([str(folder), "--prompt", "x", "--device", "cpu"]) == 2
    assert named in one_error_line(capsys)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_evaluate_scores_an_untouched_export(exports, capsys, family):
    assert evaluate.main([str(exports[family]), "--data", str(exports["data"]), "--device", "cpu"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["cross_entropy"])


def test_evaluate_refuses_weights_that_give_no_finite_loss(exports, tmp_path, capsys):
    folder = copy_of(exports["gpt2"], tmp_path / "model")
    from safetensors.torch import load_file, save_file
    weights = load_file(folder / WEIGHTS_NAME)
    weights["transformer.ln_f.weight"][:] = 3e38  # the logits overflow
    save_file(weights, folder / WEIGHTS_NAME, metadata={"format": "pt"})
    assert evaluate.main([str(folder), "--data", str(exports["data"]), "--device", "cpu"]) == 2
    assert "finite" in one_error_line(capsys)


def test_sample_keeps_to_the_models_positions(exports, capsys):
    long_prompt = "word " * (4 * POSITIONS)
    assert sample.main([str(exports["gpt2"]), "--prompt", long_prompt, "--max-new-tokens", str(4 * POSITIONS),
                        "--device", "cpu", "--continuation-only"]) == 0
    captured = capsys.readouterr()
    assert "positions" in captured.err and captured.out.endswith("\n")


@pytest.mark.parametrize("argv, named", [
    (["--device", "foo"], "--device"),
    (["--temperature", "1e-30"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--prompt", "caf\udce9"], "UTF-8"),
])
def test_sample_refuses_what_it_cannot_use_in_one_line(exports, capsys, argv, named):
    assert sample.main([str(exports["gpt2"]), "--prompt", "x", *argv]) == 2
    assert named in one_error_line(capsys)
