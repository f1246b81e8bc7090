"""What the tests share: the bundle root, the one tiny configuration and the sample input.

Test files import from here (``from tests.helpers import ...``), never from one another. The tiny
configuration is data: dotted keys over ``conf/smoke.yaml`` (or over the defaults, for a config file of
its own), rendered for whichever door a test goes through: ``--key value`` arguments for ``train.py``,
a dotlist for ``load_config``, or YAML for a config file. A test that depends on a value (a row length,
a step count) names it at the call site as an override, so what it checks stays visible there.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
import textwrap
from collections.abc import Mapping
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample.jsonl"

# One layer, 32-dimensional, two heads, rows of 64 tokens: trains in seconds on a CPU.
TINY: dict[str, object] = {
    "model.n_layer": 1,
    "model.n_embd": 32,
    "model.n_head": 2,
    "model.max_seq_len": 64,
}


def tiny(overrides: Mapping[str, object] | None = None) -> dict[str, object]:
    """The tiny configuration with ``overrides`` (dotted keys) on top; later keys replace earlier ones."""
    return {**TINY, **(overrides or {})}


# The in-process training run of the callback, observation and GPU tests (through ``load_config`` over
# conf/smoke.yaml): rows of 32 tokens, four updates, a validation every two.
IN_PROCESS_RUN = tiny({
    "model.max_seq_len": 32, "trainer.max_steps": 4, "trainer.val_every_steps": 2, "optim.warmup_steps": 1,
    "metrics.interval_seconds": 0.01, "data.val_fraction": 0.2, "data.val_max_tokens": 4096,
    "data.shuffle_buffer_docs": 64,
})


def as_args(values: Mapping[str, object]) -> list[str]:
    """``--key value`` pairs for train.py's command line."""
    return [part for key, value in values.items() for part in (f"--{key}", str(value))]


def as_dotlist(values: Mapping[str, object]) -> list[str]:
    """``key=value`` items for ``config.load_config``."""
    return [f"{key}={value}" for key, value in values.items()]


def as_yaml(values: Mapping[str, object]) -> str:
    """The dotted keys nested into sections, as YAML text for a config file."""
    nested: dict = {}
    for key, value in values.items():
        *sections, leaf = key.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return yaml.safe_dump(nested, sort_keys=False)


def write_slow_export_script(path: Path) -> Path:
    """A script that runs ``train.main`` with an export that writes the weights and then never finishes,
    deaf to Python's exceptions, as a write stuck in the kernel: what a second stop signal must end."""
    path.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import callbacks.export as export
        write = export.save_file
        def save_file(*args, **kwargs):  # the weights are written, the rest of the export never comes
            write(*args, **kwargs)
            while True:
                try:
                    time.sleep(120)
                except BaseException:
                    pass
        export.save_file = save_file
        import train
        sys.exit(train.main(sys.argv[1:]))
    """))
    return path


class Stdin(io.BufferedReader):
    """A stdin that is not a terminal, as RunFab's pipe is."""

    def isatty(self) -> bool:
        return False

def signal_twice_during_the_export(process, output: Path, log, timeout: float) -> int:
    """Wait until ``process`` (running write_slow_export_script) has written its export's weights under
    ``output``, send SIGTERM twice, a second apart, and return its exit status; ``log()`` explains a failure."""
    try:
        deadline = time.monotonic() + timeout
        while not list(output.glob(".model.tmp-*/model.safetensors")):
            assert time.monotonic() < deadline and process.poll() is None, log()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=60)
    finally:
        process.kill()



def records(n: int = 400) -> bytes:
    """The first ``n`` sample records as JSON lines holding only their text."""
    with SAMPLE.open() as f:
        lines = (json.loads(line) for line in f)
        return b"".join(json.dumps({"text": r["text"]}).encode() + b"\n" for _, r in zip(range(n), lines))


def tiktoken_encoder(path: Path):
    """The tokenizer at ``path`` through its fast backend (tiktoken); the test is skipped without tiktoken."""
    import pytest

    from pipeline.tokenizer import TextEncoder

    pytest.importorskip("tiktoken")
    encoder = TextEncoder(path)
    assert encoder.backend == "tiktoken"
    return encoder


class BrokenAfter(io.RawIOBase):
    """An input that gives ``data``, then fails like a broken device (wrap it in io.BufferedReader)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def readable(self):
        return True

    def isatty(self):
        return False

    def readinto(self, buffer):
        if not self.data:
            raise OSError(5, "Input/output error")
        n = min(len(buffer), len(self.data))
        buffer[:n], self.data = self.data[:n], self.data[n:]
        return n


CHROMIUM = Path("/usr/bin/chromium")  # Debian's; .ci/run installs it, and the browser tests skip without it


def run_chromium(*arguments: str, profile: Path, timeout: float = 60) -> bytes:
    """Headless Chromium in a session of its own, killed with all its helpers when done or after ``timeout`` s."""
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", "--force-device-scale-factor=1", f"--user-data-dir={profile}", *arguments]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return stdout
