"""The Hugging Face export computes exactly what the trainer's model computes, GPT-2 or Llama, and loads without
this package."""

import copy
import os
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: the export must load offline

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

from callbacks.export import ExportModel, export_model
from model.decoder import ModelConfig
from model.families import build_model
from model.gpt import GPT

EOS = "<|endoftext|>"
# init_std well above the default so attention is far from uniform and a q/k mix-up shows.
CONFIG = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_embd=64, max_seq_len=64, init_std=0.1)
TEXT = "the quick brown fox jumps over the lazy dog. hello world, hello tokenizer!"


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A tiny byte-level BPE, trained here so the test needs no shipped tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([TEXT] * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt():
    """Random weights, LayerNorms moved off 1/0 too, so any misplaced tensor changes the logits."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def export_dir(gpt, tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    export_model(gpt, tokenizer_path, out)
    return out


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, local_files_only=True)
    return model.eval(), info


def max_logit_diff(hf_model, gpt):
    input_ids = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (hf_model(input_ids).logits - gpt(input_ids)).abs().max().item()


def test_loads_as_tied_gpt2_with_matching_logits(export_dir, gpt):
    hf_model, info = load(export_dir)
    assert type(hf_model) is GPT2LMHeadModel
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr()
    assert hf_model.dtype == torch.float32
    assert max_logit_diff(hf_model, gpt) < 1e-4


def test_tokenizer_and_generate(export_dir, gpt, tokenizer_path):
    hf_model, _ = load(export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    assert tokenizer.eos_token == EOS
    prompt = tokenizer("hello world", return_tensors="pt")
    assert prompt.input_ids[0].tolist() == Tokenizer.from_file(str(tokenizer_path)).encode("hello world").ids

    new_tokens = 8
    with torch.no_grad():
        out = hf_model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        # The same greedy decoding with our model, as a check that generation uses the right positions.
        ours = prompt.input_ids
        for _ in range(new_tokens):
            ours = torch.cat([ours, gpt(ours)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.shape[1] == prompt.input_ids.shape[1] + new_tokens
    assert out.tolist() == ours.tolist()
    assert isinstance(tokenizer.decode(out[0], skip_special_tokens=True), str)


def test_writes_only_safetensors_and_json(export_dir):
    names = {p.name for p in export_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert all(name.endswith((".safetensors", ".json")) for name in names), names
    with safe_open(export_dir / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()
        assert all(f.get_tensor(key).dtype == torch.float32 for key in f.keys())


def swap_q_k(model):
    qkv = model.blocks[0].attn.qkv.weight
    d = CONFIG.n_embd
    qkv[: 2 * d] = torch.cat([qkv[d : 2 * d], qkv[:d]])


def swap_layer_norms(model):
    block = model.blocks[0]
    for a, b in ((block.ln_1.weight, block.ln_2.weight), (block.ln_1.bias, block.ln_2.bias)):
        a_copy = a.clone()
        a.copy_(b)
        b.copy_(a_copy)


@pytest.mark.parametrize("corrupt", [swap_q_k, swap_layer_norms])
def test_comparison_catches_a_wrong_mapping(corrupt, gpt, tokenizer_path, tmp_path):
    wrong = copy.deepcopy(gpt)
    with torch.no_grad():
        corrupt(wrong)
    export_model(wrong, tokenizer_path, tmp_path / "hf")
    hf_model, _ = load(tmp_path / "hf")
    assert max_logit_diff(hf_model, gpt) > 1e-2


def test_reexport_replaces_folder_and_failure_leaves_it(gpt, tokenizer_path, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    files = export_model(gpt, tokenizer_path, out)
    assert not (out / "stale.txt").exists()
    assert sorted(files) == sorted(p for p in out.iterdir())

    with pytest.raises(ValueError, match="has no token"):
        export_model(gpt, tokenizer_path, out, eos_token="<|missing|>")
    assert sorted(out.iterdir()) == sorted(files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folders left behind


def test_callback_exports_on_rank_zero_only(gpt, tokenizer_path, tmp_path):
    callback = ExportModel(tmp_path / "hf", tokenizer_path)
    module = SimpleNamespace(model=gpt)

    callback.on_train_end(SimpleNamespace(is_global_zero=False, global_step=3), module)
    assert not (tmp_path / "hf").exists()
    callback.on_train_end(SimpleNamespace(is_global_zero=True, global_step=0), module)  # nothing trained
    assert not (tmp_path / "hf").exists()

    callback.on_train_end(SimpleNamespace(is_global_zero=True, global_step=3), module)
    hf_model, _ = load(tmp_path / "hf")
    assert max_logit_diff(hf_model, gpt) < 1e-4


def test_the_callback_marks_its_folder_and_a_failed_write_is_one_line_with_nothing_left(
        gpt, tokenizer_path, tmp_path, monkeypatch):
    import errno

    import callbacks.export
    from callbacks.export import ExportFailed
    from callbacks.owned_folders import is_marked

    trained = SimpleNamespace(is_global_zero=True, global_step=3)
    ExportModel(tmp_path / "hf", tokenizer_path).on_train_end(trained, SimpleNamespace(model=gpt))
    assert is_marked(tmp_path / "hf")  # a later run may set it aside

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(callbacks.export, "save_file", full)
    with pytest.raises(ExportFailed) as error:
        ExportModel(tmp_path / "again", tokenizer_path).on_train_end(trained, SimpleNamespace(model=gpt))
    assert "failed after 3 optimizer steps: No space left on device" in str(error.value)
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left behind


PAGE = 4096


@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs of 16 MiB whose free space a test sets (``leave(bytes)``): a real full disk, which only
    root may mount; skipped where that is not permitted."""
    import shutil
    import subprocess

    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")

    def leave(free_bytes: int) -> None:
        stats = os.statvfs(mount_point)
        (mount_point / "filler").write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - free_bytes))

    try:
        yield mount_point, leave
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


@pytest.mark.parametrize("failing", ["model.safetensors", "tokenizer.json", "run_record.json"])
def test_a_full_disk_at_any_write_of_the_export_is_one_line_and_nothing_is_left(small_filesystem, tmp_path, failing):
    """The weights (safetensors), the tokenizer (tokenizers) and the record each meet a real ENOSPC;
    each library's own error becomes the one line of ExportFailed, and no folder is left behind."""
    from callbacks.export import ExportFailed

    mount_point, leave = small_filesystem
    model = GPT(ModelConfig(vocab_size=8192, n_layer=1, n_head=2, n_embd=32, max_seq_len=32))
    tokenizer = "conf/tokenizer.json"

    def record(trainer, module, staging):
        (staging / "run_record.json").write_text("{}" + " " * (256 << 10) + "\n")

    trained = SimpleNamespace(is_global_zero=True, global_step=3)
    ExportModel(tmp_path / "reference", tokenizer, published_with=record).on_train_end(trained, SimpleNamespace(model=model))
    written = sorted((tmp_path / "reference").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    names = [p.name for p in written]
    assert failing in names and (tmp_path / "reference" / failing).stat().st_size > 16 * PAGE
    before = sum(pages(p.stat().st_size) for p in written[:names.index(failing)])
    leave(before + pages((tmp_path / "reference" / failing).stat().st_size) // 2)

    with pytest.raises(ExportFailed) as error:
        ExportModel(mount_point / "model", tokenizer, published_with=record).on_train_end(
            trained, SimpleNamespace(model=model))
    message = str(error.value)
    assert "failed after 3 optimizer steps: No space left on device" in message and "nothing was exported" in message
    assert "\n" not in message
    assert sorted(p.name for p in mount_point.iterdir()) == ["filler"]


# ----------------------------------------------------------------------------- the llama family


def llama(tie_embeddings: bool, qk_norm: bool = False) -> torch.nn.Module:
    """A Llama with fewer key/value heads than query heads and a rotary base off the default, its norms moved off 1,
    so that a misplaced tensor, a wrong head grouping or a wrong rotary convention changes the logits."""
    torch.manual_seed(1)
    config = ModelConfig(family="llama", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=64,
                         init_std=0.1, rope_theta=500.0, tie_embeddings=tie_embeddings, qk_norm=qk_norm)
    model = build_model(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_llama_loads_as_llama_for_causal_lm_with_the_trainers_logits(tied, tokenizer_path, tmp_path):
    from transformers import LlamaForCausalLM

    model = llama(tie_embeddings=tied)
    export_model(model, tokenizer_path, tmp_path / "hf")
    hf_model, info = load(tmp_path / "hf")
    assert type(hf_model) is LlamaForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf_model.config.num_key_value_heads == 2 < hf_model.config.num_attention_heads
    tied_in_hf = hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert tied_in_hf == tied
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied
    assert_same_logits(hf_model, model)


def assert_same_logits(hf_model, model) -> torch.Tensor:
    """The export's logits are the trainer's, on whole rows and on a packed row's second document (the trainer's,
    its positions restarting, is Hugging Face's alone); returns the rows used."""
    input_ids = torch.randint(0, 300, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf_model(input_ids).logits - model(input_ids)).abs().max().item() < 1e-5
        positions = torch.cat([torch.arange(20), torch.arange(44)]).expand(3, 64)
        packed = model(input_ids, positions)[:, 20:]
        assert (hf_model(input_ids[:, 20:]).logits - packed).abs().max().item() < 1e-5
    return input_ids


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_llama_with_qk_norm_loads_as_qwen3_for_causal_lm_with_the_trainers_logits(tied, tokenizer_path, tmp_path):
    import json

    from transformers import Qwen3ForCausalLM

    model = llama(tie_embeddings=tied, qk_norm=True)  # q_norm and k_norm moved off 1 too, each its own
    export_model(model, tokenizer_path, tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert settings["model_type"] == "qwen3" and settings["architectures"] == ["Qwen3ForCausalLM"]
    assert settings["rope_theta"] == 500.0 and not settings["use_sliding_window"]
    hf_model, info = load(tmp_path / "hf")
    assert type(hf_model) is Qwen3ForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(hf_model.model.layers[1].self_attn.k_norm.weight, model.blocks[1].attn.k_norm.weight)
    input_ids = assert_same_logits(hf_model, model)
    with torch.no_grad():
        swapped = copy.deepcopy(model)
        for block in swapped.blocks:
            block.attn.q_norm.weight, block.attn.k_norm.weight = block.attn.k_norm.weight, block.attn.q_norm.weight
        assert (hf_model(input_ids).logits - swapped(input_ids)).abs().max().item() > 1e-3


def test_a_llama_export_names_its_rotary_base_for_transformers_4_and_5(tokenizer_path, tmp_path):
    import json

    export_model(llama(tie_embeddings=True), tokenizer_path, tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert settings["model_type"] == "llama" and settings["architectures"] == ["LlamaForCausalLM"]
    assert settings["rope_theta"] == 500.0
    assert settings.get("rope_parameters", {"rope_theta": 500.0})["rope_theta"] == 500.0
    eos_id = Tokenizer.from_file(str(tokenizer_path)).token_to_id(EOS)
    assert settings["pad_token_id"] == settings["eos_token_id"] == eos_id


def swap_k_v(model):
    qkv = model.blocks[0].attn.qkv.weight
    q_rows, kv_rows = 4 * 16, 2 * 16
    qkv[q_rows:] = torch.cat([qkv[q_rows + kv_rows:], qkv[q_rows:q_rows + kv_rows]])


def swap_gate_up(model):
    weight = model.blocks[0].mlp.gate_up.weight
    weight.copy_(torch.cat(weight.chunk(2)[::-1]))


@pytest.mark.parametrize("corrupt", [swap_k_v, swap_gate_up])
def test_the_llama_comparison_catches_a_wrong_mapping(corrupt, tokenizer_path, tmp_path):
    model = llama(tie_embeddings=True)
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        corrupt(wrong)
    export_model(wrong, tokenizer_path, tmp_path / "hf")
    hf_model, _ = load(tmp_path / "hf")
    input_ids = torch.randint(0, 300, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf_model(input_ids).logits - model(input_ids)).abs().max().item() > 1e-2
