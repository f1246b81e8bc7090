"""End to end: train.py run the way RunFab runs it, each case in a fresh interpreter.

Every test runs in the contract check's own sandbox (tools/bundle/sandbox.py's ``Sandbox``): the bundle
(what ``shipping.shipped_files`` says ships: train.py, the other modules, callbacks/, conf/, data/)
unpacked into a temporary folder and made read-only, like /workspace. The child process gets
``CUDA_VISIBLE_DEVICES=""``, ``RUNFABRIC_OUTPUT`` pointing at a writable folder, a working
directory of its own that starts empty, and its own HOME and TMPDIR, so every place a stray
write could land is a folder the test can look into afterwards.

The configurations are the tests' tiny one (tests/helpers.py: one layer, 32-dimensional, rows of 64 tokens) so each run takes
a few seconds beyond the ~10 s it costs to import Lightning.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import math
import os
import re
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tools.bundle.sandbox import BundleSource, set_writable
from tools.bundle.sandbox import Sandbox as CheckerSandbox

from tests.helpers import ROOT, as_yaml, tiny

EFFECTIVE_BATCH_SIZE = 32  # what the contract under test promises; train.py is read, not imported, here
MICROBATCH = 4
SEQ_LEN = 64
CHILD_TIMEOUT = 300

def e2e_config(max_steps: int, sample_path: str, source: str) -> str:
    """The tiny model as a bundle's own config file (no smoke.yaml under it), at this module's batch."""
    return as_yaml(tiny({
        "seed": 7, "model.vocab_size": 8192, "model.max_seq_len": SEQ_LEN,
        "data.tokenizer": "conf/tokenizer.json", "data.source": source, "data.sample_path": sample_path,
        "data.microbatch": MICROBATCH, "data.val_fraction": 0.05, "data.val_max_tokens": 4096,
        "data.shuffle_buffer_docs": 64,
        "optim.lr": 1.0e-3, "optim.warmup_steps": 1, "optim.schedule": "cosine", "optim.decay_steps": 50,
        "trainer.max_steps": max_steps, "trainer.val_every_steps": 2, "metrics.interval_seconds": 0.5,
        "output.root": "${oc.env:RUNFABRIC_OUTPUT,output}",
    }))


CONFIGS = {
    "conf/e2e_tiny.yaml": dict(max_steps=3, sample_path="data/sample.jsonl", source="auto"),
    # Trains until the input ends, so every injected line is read and the whole input is hashed.
    "conf/e2e_until_eof.yaml": dict(max_steps=-1, sample_path="data/sample.jsonl", source="auto"),
    "conf/e2e_missing_sample.yaml": dict(max_steps=3, sample_path="data/missing.jsonl", source="sample"),
}

METRIC_KEYS = {"step", "elapsed_seconds", "loss", "tokens_per_second"}  # what RunFab's graphs plot


# ----------------------------------------------------------------------------- fixtures


def _add_configs(bundle: Path) -> None:
    """This module's config files, written into the unpacked bundle before it turns read-only."""
    for rel, values in CONFIGS.items():
        (bundle / rel).write_text(e2e_config(**values))


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` with its kind, size and modification time."""
    entries = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        entries[p.relative_to(root).as_posix()] = (stat.S_IFMT(st.st_mode), st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return entries


def files_under(root: Path) -> list[str]:
    """Regular files (and links) under ``root``; empty folders are not counted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())


class Sandbox(CheckerSandbox):
    """The contract checker's own sandbox (a read-only unpacked bundle plus the writable places a run
    may, output, or may not, cwd and home, touch), with this module's configs, environment and helpers."""

    def __init__(self, base: Path) -> None:
        super().__init__(BundleSource.open(ROOT), keep=True, base=base, prepare=_add_configs)
        self.scripts = self.control  # the test's own child scripts and reports, outside every checked folder
        self.bundle_before = snapshot(self.bundle)

    @property
    def model_dir(self) -> Path:
        return self.output / "model"

    def env(self, config: str = "conf/e2e_tiny.yaml") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNFAB", "PYTHON", "HF_", "TRANSFORMERS_"))}
        env.update(
            CUDA_VISIBLE_DEVICES="",
            RUNFABRIC_OUTPUT=str(self.output),
            RUNFAB_CONFIG=config,
            HOME=str(self.home),
            TMPDIR=str(self.tmp),
            HF_HUB_OFFLINE="1",
            # As root a read-only bundle still accepts writes; the interpreter's own byte-code
            # cache is not the trainer's doing, so it is switched off instead of being flagged.
            PYTHONDONTWRITEBYTECODE="1",
        )
        return env

    def child(self, body: str, *, stdin=None, input_bytes: bytes | None = None, config: str = "conf/e2e_tiny.yaml",
              timeout: float = CHILD_TIMEOUT) -> tuple[subprocess.CompletedProcess, dict | None]:
        """Run ``body`` in a fresh interpreter that imports from the bundle; ``report`` is its JSON result."""
        script = self.scripts / f"child_{len(list(self.scripts.iterdir()))}.py"
        report = script.with_suffix(".json")
        script.write_text(
            "import json, os, sys\n"
            f"sys.path.insert(0, {str(self.bundle)!r})\n"
            f"REPORT_PATH = {str(report)!r}\n"
            "report = {}\n"
            "def read_stdin_fd():\n"
            "    # fd 0 directly: bytes that Python's sys.stdin buffered (peeked) would be missing here\n"
            "    chunks = []\n"
            "    while True:\n"
            "        chunk = os.read(0, 1 << 16)\n"
            "        if not chunk:\n"
            "            return b''.join(chunks)\n"
            "        chunks.append(chunk)\n"
            + textwrap.dedent(body)
            + "\nwith open(REPORT_PATH, 'w') as f:\n    json.dump(report, f)\n"
        )
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=self.cwd, env=self.env(config), stdin=stdin, input=input_bytes,
            capture_output=True, timeout=timeout,
        )
        return proc, json.loads(report.read_text()) if report.exists() else None

    def cli(self, args: list[str], *, stdin=subprocess.DEVNULL, timeout: float = CHILD_TIMEOUT) -> subprocess.CompletedProcess:
        env = self.env()
        env.pop("RUNFAB_CONFIG")
        return subprocess.run(
            [sys.executable, str(self.bundle / "train.py"), *args], cwd=self.cwd, env=env, stdin=stdin,
            capture_output=True, timeout=timeout,
        )

    def assert_bundle_untouched(self) -> None:
        after = snapshot(self.bundle)
        added = sorted(set(after) - set(self.bundle_before))
        changed = sorted(k for k in self.bundle_before if after.get(k) != self.bundle_before[k])
        assert not added and not changed, f"the run wrote into the read-only bundle: added {added}, changed {changed}"

    def assert_no_stray_files(self) -> None:
        """Nothing in the working directory, HOME or TMPDIR, not even an empty folder (importing Lightning
        makes TMPDIR/torchinductor_<user>, and matplotlib's font cache needs a folder: neither stays)."""
        assert sorted(os.listdir(self.cwd)) == [], "the run wrote into its working directory"
        assert files_under(self.home) == [], "the run wrote into HOME"
        assert sorted(os.listdir(self.tmp)) == [], "the run left something in TMPDIR"
        self.assert_bundle_untouched()


@pytest.fixture
def sandbox(tmp_path):
    box = Sandbox(tmp_path)
    yield box
    set_writable(box.bundle, True)  # so pytest can remove tmp_path


# ----------------------------------------------------------------------------- helpers


def sample_lines(n: int) -> list[bytes]:
    with (ROOT / "data" / "sample.jsonl").open("rb") as f:
        lines = [line for _, line in zip(range(n), f)]
    assert len(lines) == n and all(json.loads(line)["text"].strip() for line in lines)
    return lines


def metric_lines(stdout: bytes) -> list[dict]:
    """Every stdout line must be a metrics object of finite numbers, under RunFab's line limit."""
    records = []
    text = stdout.decode("utf-8")
    assert text == "" or text.endswith("\n"), "stdout ends in a partial line"
    for line in text.splitlines():
        assert len(line) < 8192, f"metrics line of {len(line)} characters"
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"stdout carries a line that is not JSON: {line[:300]!r}")
        assert isinstance(record, dict), f"stdout line is not an object: {line!r}"
        assert METRIC_KEYS <= record.keys(), f"metrics line without {METRIC_KEYS - record.keys()}: {line!r}"
        for key, value in record.items():
            assert type(value) in (int, float) and math.isfinite(value), f"{key}={value!r} in {line!r}"
        for key in ("tokens_per_second", "samples_per_second", "elapsed_seconds"):
            assert record.get(key, 0) >= 0, f"negative {key} in {line!r}"
        records.append(record)
    steps = [r["step"] for r in records]
    elapsed = [r["elapsed_seconds"] for r in records]
    assert steps == sorted(steps) and elapsed == sorted(elapsed), "steps or elapsed time go backwards"
    return records


def assert_no_model(sandbox: Sandbox) -> None:
    assert not sandbox.model_dir.exists(), "a failed run exported a model"
    assert files_under(sandbox.output) == [], f"a failed run left files in the output: {files_under(sandbox.output)}"


def assert_export_loads(sandbox: Sandbox) -> str:
    """Load the export with transformers alone (no bundle on sys.path, offline, empty HF cache) and generate."""
    code = textwrap.dedent(
        f"""
        import json, sys
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        assert not any('workspace' in p for p in sys.path)
        path = {str(sandbox.model_dir)!r}
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        prompt = "The function returns"
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1]:]
        print(json.dumps({{"new_tokens": int(new.numel()), "text": tokenizer.decode(new),
                          "prompt_roundtrip": tokenizer.decode(inputs["input_ids"][0]),
                          "n_layer": model.config.n_layer, "n_positions": model.config.n_positions}}))
        """
    )
    env = sandbox.env()
    env["HF_HOME"] = str(sandbox.scripts / "hf_home")
    proc = subprocess.run([sys.executable, "-c", code], cwd=sandbox.scripts, env=env, capture_output=True,
                          timeout=CHILD_TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert result["new_tokens"] == 8
    assert isinstance(result["text"], str) and result["text"], "generate() produced no text"
    assert result["prompt_roundtrip"] == "The function returns"
    assert result["n_layer"] == 1 and result["n_positions"] == SEQ_LEN
    return result["text"]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stderr_of(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- 1. import


def test_import_has_no_side_effects(sandbox):
    payload = b"".join(sample_lines(400))  # several pipe buffers: a reader would get some of it
    assert len(payload) > 1 << 17
    proc, report = sandbox.child(
        """
        import inspect
        import train
        import torch
        report["cuda_initialized"] = torch.cuda.is_initialized()
        report["effective"] = train.EFFECTIVE_BATCH_SIZE
        report["effective_type"] = type(train.EFFECTIVE_BATCH_SIZE).__name__
        report["probe_params"] = list(inspect.signature(train.probe_batch).parameters)
        report["train_params"] = list(inspect.signature(train.train).parameters)
        report["train_file"] = train.__file__
        data = read_stdin_fd()
        report["stdin_bytes"] = len(data)
        import hashlib
        report["stdin_sha256"] = hashlib.sha256(data).hexdigest()
        """,
        input_bytes=payload,
    )
    assert proc.returncode == 0, stderr_of(proc)[-4000:]
    assert report["train_file"] == str(sandbox.bundle / "train.py")
    assert proc.stdout == b"", f"importing train printed on stdout: {proc.stdout[:500]!r}"
    assert report["stdin_bytes"] == len(payload), "importing train consumed stdin"
    assert report["stdin_sha256"] == hashlib.sha256(payload).hexdigest()
    assert report["cuda_initialized"] is False
    assert report["effective"] == EFFECTIVE_BATCH_SIZE and report["effective_type"] == "int"
    assert report["probe_params"] == ["microbatch"]
    assert report["train_params"] == ["microbatch", "accumulation"]
    assert files_under(sandbox.output) == [] and os.listdir(sandbox.output) == []
    sandbox.assert_no_stray_files()


def test_effective_batch_size_is_a_literal_module_constant():
    tree = ast.parse((ROOT / "train.py").read_text())
    assignments = [
        node for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        and any(isinstance(t, ast.Name) and t.id == "EFFECTIVE_BATCH_SIZE"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
    ]
    assert len(assignments) == 1, "EFFECTIVE_BATCH_SIZE must be assigned exactly once"
    (node,) = assignments
    assert node in tree.body, "EFFECTIVE_BATCH_SIZE must be assigned at module level"
    assert isinstance(node.value, ast.Constant) and type(node.value.value) is int, "not a literal int"
    assert node.value.value == EFFECTIVE_BATCH_SIZE and 1 <= node.value.value <= 65536
    globals_ = [n for n in ast.walk(tree) if isinstance(n, ast.Global) and "EFFECTIVE_BATCH_SIZE" in n.names]
    assert not globals_, "a function rebinds EFFECTIVE_BATCH_SIZE"


# ----------------------------------------------------------------------------- 2. probe


def test_probe_is_real_and_leaves_nothing_behind(sandbox):
    payload = b"".join(sample_lines(400))
    proc, report = sandbox.child(
        f"""
        import psutil, torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        from torch.nn.modules.module import register_module_forward_pre_hook
        import train
        state_before_step = []  # per optimizer step: parameters that already had optimizer state
        register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: state_before_step.append(sum(1 for s in opt.state.values() if s)))
        shapes = set()
        register_module_forward_pre_hook(
            lambda m, inp: shapes.add(tuple(inp[0].shape)) if isinstance(m, torch.nn.Embedding) else None)
        report["returned"] = repr(train.probe_batch({MICROBATCH}))
        report["tmp_after_probe"] = sorted(os.listdir(os.environ["TMPDIR"]))  # before the interpreter's exit
        report["state_before_step"] = state_before_step
        report["embedding_input_shapes"] = sorted(shapes)
        report["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
        report["cuda_initialized"] = torch.cuda.is_initialized()
        report["stdin_bytes"] = len(read_stdin_fd())
        """,
        input_bytes=payload,
    )
    assert proc.returncode == 0, stderr_of(proc)[-4000:]
    assert proc.stdout == b"", f"the probe wrote on stdout: {proc.stdout[:500]!r}"
    assert report["stdin_bytes"] == len(payload), "the probe consumed stdin"
    assert report["children"] == [], "the probe left child processes running"
    steps = report["state_before_step"]
    assert len(steps) >= 2, f"the probe took {len(steps)} optimizer steps"
    assert steps[0] == 0 and max(steps[1:]) > 0, "no step ran with the optimizer state already allocated"
    # worst case: full microbatch of full-length rows through the real embedding
    assert [MICROBATCH, SEQ_LEN] in report["embedding_input_shapes"], report["embedding_input_shapes"]
    assert os.listdir(sandbox.output) == [], f"the probe wrote into the output root: {files_under(sandbox.output)}"
    assert report["tmp_after_probe"] == [], "the probe left folders in TMPDIR for the interpreter's exit to remove"
    sandbox.assert_no_stray_files()


# ----------------------------------------------------------------------------- 3. train


BAD_LINES = {
    # reason -> the lines that must be rejected for it
    "invalid_json": [b'{"text": "never closed\n', b"not json at all\n"],
    "not_an_object": [b'["text", "a list"]\n'],
    "no_text_or_input_ids": [b'{"body": "the field has the wrong name"}\n'],
    "empty_text": [b'{"text": "   "}\n'],
    "invalid_utf8": [b'{"text": "caf\xe9 \xff\xfe"}\n'],
    "input_ids_out_of_range": [b'{"input_ids": [1, 2, 8192]}\n'],
    "record_too_large": [b'{"text": "' + b"x" * ((1 << 20) + 100) + b'"}\n'],
}


def mixed_input(path: Path, good: int = 320) -> dict:
    """Real text with every kind of bad line (and a valid input_ids record) spread through it."""
    lines = sample_lines(good)
    bad = [line for reason_lines in BAD_LINES.values() for line in reason_lines]
    extra_good = [b'{"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 8191]}\n']
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i % 7 == 3 and bad:
            out.append(bad.pop(0))
        if i == 20:
            out.extend(extra_good)
            out.append(b"\n")  # blank lines are skipped, not counted
    assert not bad
    path.write_bytes(b"".join(out))
    return {"records": good + len(extra_good) + sum(len(v) for v in BAD_LINES.values()),
            "accepted": good + len(extra_good),
            "rejected": {reason: len(v) for reason, v in BAD_LINES.items()}}


def test_train_streams_stdin_skips_bad_records_and_exports(sandbox):
    data = sandbox.scripts / "input.jsonl"
    expected = mixed_input(data)
    k = MICROBATCH
    with data.open("rb") as stdin:
        proc, report = sandbox.child(
            f"""
            import train
            report["result"] = train.train({k}, {EFFECTIVE_BATCH_SIZE // k})
            """,
            stdin=stdin, config="conf/e2e_until_eof.yaml",
        )
    err = stderr_of(proc)
    assert proc.returncode == 0, err[-4000:]
    assert "litlogger" not in err  # Lightning's advertisement for its hosted logger is not ours to show

    metrics = metric_lines(proc.stdout)
    trained = [m for m in metrics if "loss" in m]
    assert trained, "no metrics line with a training loss"
    assert all("tokens_per_second" in m and m["tokens_per_second"] > 0 for m in trained)
    assert any("val_loss" in m for m in metrics), "validation was configured every 2 steps but never reported"

    for reason, n in expected["rejected"].items():
        assert re.search(rf"{reason}\W{{0,3}}{n}\b", err), f"stderr does not report {n} {reason}"

    record = json.loads((sandbox.model_dir / "run_record.json").read_text())
    stats = record["input"]
    assert stats["source"] == "stdin"
    assert stats["end_of_input"] is True
    assert stats["rejected"] == expected["rejected"]
    assert stats["records"] == expected["records"] and stats["accepted"] == expected["accepted"]
    # every complete update was trained, and only complete updates: -1 steps means "until the input ends"
    assert stats["updates"] > 3
    assert record["optimizer_steps"] == stats["updates"] == metrics[-1]["step"]
    assert record["batch"] == {"effective": EFFECTIVE_BATCH_SIZE, "microbatch": k, "accumulation": EFFECTIVE_BATCH_SIZE // k,
                               "world_size": 1, "tokens_per_update": EFFECTIVE_BATCH_SIZE * SEQ_LEN}
    assert record["config"]["model"]["n_layer"] == 1 and record["config"]["model"]["max_seq_len"] == SEQ_LEN
    assert record["config"]["trainer"]["max_steps"] == -1 and record["seed"] == record["config"]["seed"] == 7
    assert record["kernels"]["loss"] == {"requested": "auto", "ran": "eager"}  # its kernels: compiled CUDA runs
    assert record["kernels"]["mlp"] == {"requested": "auto", "ran": "torch",  # quack's GEMMs: compiled CUDA runs
                                        "blocks_keeping_the_gelu_derivative": 0}
    sources = record["sources_sha256"]
    for rel in ("train.py", "datamodule.py", "model/gpt.py", "callbacks/export.py", "conf/e2e_until_eof.yaml"):
        assert sources.get(rel) == sha256_of(sandbox.bundle / rel), f"sources_sha256 of {rel}"
    assert not any(rel.startswith("data/") for rel in sources), "the data sample is not source code"
    assert record["tokenizer"]["sha256"] == sha256_of(sandbox.bundle / "conf" / "tokenizer.json")
    assert report["result"]["steps"] == record["optimizer_steps"]

    exported = {p.name for p in sandbox.model_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "run_record.json"} <= exported
    assert not any(name.endswith((".pt", ".pth", ".bin", ".ckpt")) for name in exported), exported
    leftovers = sorted(set(os.listdir(sandbox.output)) - {"model", "checkpoints", "data", "run"})
    assert not leftovers, f"unexpected entries in the output root: {leftovers}"
    saved = (sandbox.output / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in saved] == metrics  # the run keeps exactly what RunFab was sent
    sandbox.assert_no_stray_files()
    assert_export_loads(sandbox)


def test_input_sha256_covers_the_whole_input(sandbox):
    """The run record's input_sha256 is the SHA-256 of the bytes that arrived, oversized lines included."""
    data = sandbox.scripts / "input.jsonl"
    mixed_input(data, good=200)
    with data.open("rb") as stdin:
        proc, _ = sandbox.child(
            f"import train\ntrain.train({MICROBATCH}, {EFFECTIVE_BATCH_SIZE // MICROBATCH})\n",
            stdin=stdin, config="conf/e2e_until_eof.yaml",
        )
    assert proc.returncode == 0, stderr_of(proc)[-4000:]
    stats = json.loads((sandbox.model_dir / "run_record.json").read_text())["input"]
    assert stats["end_of_input"] is True
    assert (stats["input_sha256"], stats["bytes_read"]) == (sha256_of(data), data.stat().st_size)


def test_rejected_counts_reach_stderr_when_max_steps_ends_the_run(sandbox):
    """RunFab's usual case: the step limit, not the input, ends the run; the reject summary must still be logged."""
    data = sandbox.scripts / "input.jsonl"
    expected = mixed_input(data, good=1500)  # far more than 3 steps need
    with data.open("rb") as stdin:
        proc, _ = sandbox.child(
            f"import train\ntrain.train({MICROBATCH}, {EFFECTIVE_BATCH_SIZE // MICROBATCH})\n",
            stdin=stdin, config="conf/e2e_tiny.yaml",
        )
    err = stderr_of(proc)
    assert proc.returncode == 0, err[-4000:]
    record = json.loads((sandbox.model_dir / "run_record.json").read_text())
    assert record["optimizer_steps"] == 3 and record["input"]["end_of_input"] is False
    assert record["input"]["rejected"] == expected["rejected"]  # all bad lines sit in the first ~60 records
    for reason, n in expected["rejected"].items():
        assert re.search(rf"{reason}\W{{0,3}}{n}\b", err), f"stderr does not report {n} {reason}"


def test_train_refuses_a_split_that_breaks_the_effective_batch(sandbox):
    payload = b"".join(sample_lines(50))
    proc, report = sandbox.child(
        """
        import train
        report["errors"] = []
        for microbatch, accumulation in [(3, 5), (16, 4), (0, 32)]:
            try:
                train.train(microbatch, accumulation)
            except Exception as error:
                report["errors"].append([type(error).__name__, str(error)])
            else:
                report["errors"].append(None)
        report["stdin_bytes"] = len(read_stdin_fd())
        """,
        input_bytes=payload,
    )
    assert proc.returncode == 0, stderr_of(proc)[-4000:]
    assert len(report["errors"]) == 3
    for error in report["errors"]:
        assert error is not None, "train() accepted a split whose product is not EFFECTIVE_BATCH_SIZE"
        assert "EFFECTIVE_BATCH_SIZE" in error[1] and str(EFFECTIVE_BATCH_SIZE) in error[1], error
    assert report["stdin_bytes"] == len(payload), "a refused split consumed stdin"
    assert proc.stdout == b""
    assert_no_model(sandbox)
    sandbox.assert_no_stray_files()


# ----------------------------------------------------------------------------- 4. image records


def image_record(i: int) -> bytes:
    pixels = hashlib.sha256(str(i).encode()).digest() * 64  # 2 KiB of "image"
    return json.dumps({
        "image_b64": base64.b64encode(pixels).decode(), "labels": [[0, 0.5, 0.5, 0.2, 0.3]],
        "boxes": [[0.5, 0.5, 0.2, 0.3]], "class_ids": [0], "id": f"img-{i}", "split": "train", "epoch": 0,
    }).encode() + b"\n"


def test_image_stream_fails_fast_with_a_clear_message(sandbox):
    """An endless stream of YOLO image records: the trainer must give up early, not read it all or hang."""
    stdout_path, stderr_path = sandbox.scripts / "stdout", sandbox.scripts / "stderr"
    script = sandbox.scripts / "image_child.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(sandbox.bundle)!r})\nimport train\n"
                      f"train.train({MICROBATCH}, {EFFECTIVE_BATCH_SIZE // MICROBATCH})\n")
    cap = 200_000  # ~600 MB: a trainer that reads on would be killed by the timeout long before
    written = {"records": 0, "broken_pipe": False}

    def feed(pipe):
        try:
            for i in range(cap):
                pipe.write(image_record(i))
                written["records"] += 1
        except (BrokenPipeError, ValueError, OSError):
            written["broken_pipe"] = True
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    start = time.monotonic()
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=sandbox.cwd, env=sandbox.env(),
                                stdin=subprocess.PIPE, stdout=out, stderr=err)
        writer = threading.Thread(target=feed, args=(proc.stdin,), daemon=True)
        writer.start()
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("an image stream did not fail within 60 s")
        elapsed = time.monotonic() - start
        writer.join(timeout=10)
    err = stderr_path.read_text(errors="replace")
    assert rc != 0, "an image stream was accepted"
    assert elapsed < 60
    assert written["broken_pipe"] and written["records"] < 5000, f"the trainer read {written['records']} image records"
    assert '"text"' in err and '"input_ids"' in err, err[-3000:]
    assert "image_b64" in err, "the message does not name the fields it found"
    assert stdout_path.read_bytes() == b"", "metrics were reported for a run that trained nothing"
    assert_no_model(sandbox)
    sandbox.assert_no_stray_files()
    print(f"image stream refused after {elapsed:.1f} s (incl. startup), {written['records']} records written")


# ----------------------------------------------------------------------------- 5. command line


def test_cli_trains_on_the_bundled_sample_when_asked_to(sandbox):
    proc = sandbox.cli(["--config", "conf/e2e_tiny.yaml", "--trainer.max_steps", "2", "--data.source", "sample"])
    err = stderr_of(proc)
    assert proc.returncode == 0, err[-4000:]
    sample = str(sandbox.bundle / "data" / "sample.jsonl")
    assert sample in err, "stderr does not say the bundled sample is being read"
    metrics = metric_lines(proc.stdout)
    assert any("loss" in m for m in metrics) and metrics[-1]["step"] == 2
    record = json.loads((sandbox.model_dir / "run_record.json").read_text())
    assert record["input"]["source"] == sample
    assert record["optimizer_steps"] == 2 and record["config"]["trainer"]["max_steps"] == 2
    assert record["batch"]["microbatch"] == MICROBATCH  # data.microbatch of the config, for local runs
    assert (sandbox.model_dir / "model.safetensors").is_file()
    sandbox.assert_no_stray_files()


@pytest.mark.parametrize(
    "args, mentions",
    [
        (["--model.n_layer", "abc"], "n_layer"),
        (["--trainer.max_steps"], "--trainer.max_steps"),
        (["stray"], "stray"),
    ],
    ids=["bad-value", "missing-value", "stray-argument"],
)
def test_cli_rejects_bad_overrides_readably(sandbox, args, mentions):
    proc = sandbox.cli(["--config", "conf/e2e_tiny.yaml", *args])
    err = stderr_of(proc)
    assert proc.returncode == 2, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert mentions in err and "error" in err.lower(), err
    assert proc.stdout == b""
    assert_no_model(sandbox)
    sandbox.assert_no_stray_files()


# ----------------------------------------------------------------------------- 6. no input at all


def test_empty_stdin_through_the_hook_is_an_error_naming_the_cause(sandbox):
    proc, _ = sandbox.child(
        f"import train\ntrain.train({MICROBATCH}, {EFFECTIVE_BATCH_SIZE // MICROBATCH})\n", input_bytes=b"",
    )
    err = stderr_of(proc)
    assert proc.returncode != 0
    assert "stdin is empty" in err and "data.source sample" in err, err[-3000:]
    assert proc.stdout == b""
    assert_no_model(sandbox)
    sandbox.assert_no_stray_files()


def test_a_missing_sample_names_the_path(sandbox):
    missing = str(sandbox.bundle / "data" / "missing.jsonl")
    proc, _ = sandbox.child(
        f"import train\ntrain.train({MICROBATCH}, {EFFECTIVE_BATCH_SIZE // MICROBATCH})\n",
        input_bytes=b"", config="conf/e2e_missing_sample.yaml",
    )
    err = stderr_of(proc)
    assert proc.returncode != 0
    assert missing in err and "data.source is sample" in err, err[-3000:]
    assert proc.stdout == b""
    assert_no_model(sandbox)
    sandbox.assert_no_stray_files()


def test_cli_missing_sample_exits_2(sandbox):
    proc = sandbox.cli(["--config", "conf/e2e_missing_sample.yaml"])
    err = stderr_of(proc)
    assert proc.returncode == 2, err[-3000:]
    assert str(sandbox.bundle / "data" / "missing.jsonl") in err and "Traceback" not in err, err[-3000:]
    assert proc.stdout == b""
    assert_no_model(sandbox)
    sandbox.assert_no_stray_files()
