"""What the benchmarks share: where results go, run metadata, child processes, step comparison, batches.

Every benchmark runs from the repository root as ``python -m benchmarks.<name>`` (``benchmarks`` and
``tests`` are packages there; no script edits ``sys.path``).

Results
-------
A benchmark writes ``benchmarks/results/<benchmark>/latest.json``: the newest run of its default
configuration, replaced by the next run (git keeps the earlier ones). A configuration kept apart writes
``latest-<label>.json`` beside it: a variant flag (``--quick`` writes ``latest-quick.json``), another device
(``latest-h200.json``, :func:`device_label`), or a run given its own ``--out`` (the sweep sample,
``hf_sweep/latest-sample.json``).
So every file in a benchmark's folder is the newest of its kind; nothing superseded stays there.
``python -m benchmarks.report`` builds ``benchmarks/RESULTS.md`` from these files. Input data that is not
a result (the recorded inexact fuzz models ``exactness_fuzz --replay`` reads) lives in ``benchmarks/data/``.

Child processes
---------------
:func:`run_child` runs ``python -m <module> --child PATH ARGS...`` from the repository root; the child
finds its arguments with :func:`child_args`, and writes one JSON record to ``PATH`` (:func:`child_record`
writes the record of a function or the error it raised). The parent gets a :class:`Child`: the record (or
``None``), the exit code (``None`` after a timeout), the output's tail and the wall time.
:func:`cases_in_processes` runs several such children at once.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / "benchmarks" / "data"
SRC = ROOT / "src"


# --------------------------------------------------------------------------
# where results go
# --------------------------------------------------------------------------
def result_path(benchmark: str, label: str | None = None, suffix: str = ".json") -> str:
    """``benchmarks/results/<benchmark>/latest.json``, or ``latest-<label>.json`` for a configuration kept
    apart (``suffix`` ``.png`` for a figure beside it)."""
    return str(RESULTS / benchmark / (f"latest-{label}" if label else "latest")) + suffix


def device_label(device: str) -> str:
    """The label of a device in result file names: ``cpu``, or the GPU's model in lower case (``h100``,
    ``h200``: the first word of its name after the vendor's)."""
    if not str(device).startswith("cuda"):
        return str(device).split(":")[0]
    import torch

    if not torch.cuda.is_available():
        return "cuda"
    words = [w for w in torch.cuda.get_device_name().lower().split() if w not in ("nvidia", "amd", "tesla")]
    return words[0] if words else "cuda"


def write_json(path, data, indent: int | None = 1) -> None:
    """``data`` as JSON at ``path`` (folders made; written to a temporary file, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------
def command_line() -> str:
    """The command that started this process, as a reader would type it from the repository root."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None and spec.name else \
        "python " + os.path.relpath(sys.argv[0])
    return " ".join([head] + sys.argv[1:])


def code_version() -> dict:
    """Which ckptopt ran: its source folder and commit, and whether ``src/`` had uncommitted edits.

    To benchmark a fixed commit while the checkout changes: ``git archive HEAD src | tar -x -C DIR`` and
    ``PYTHONPATH=DIR/src`` (children inherit it); ``CKPTOPT_SWEEP_COMMIT`` then names the commit.
    """
    try:
        import ckptopt

        src = os.path.dirname(os.path.dirname(os.path.abspath(ckptopt.__file__)))
    except ImportError:
        src = str(SRC)
    out = dict(ckptopt_src=src, ckptopt_commit=os.environ.get("CKPTOPT_SWEEP_COMMIT"))
    try:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                              cwd=src).stdout.strip()
        if root:
            out["ckptopt_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                   text=True, cwd=src).stdout.strip()
            out["src_edited"] = bool(subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True,
                                                    text=True, cwd=root).stdout.strip())
    except OSError:
        pass
    return out


def run_metadata(benchmark: str, device: str | None = None) -> dict:
    """Name, date, machine, torch version, the ckptopt commit and the exact command of this run; with
    ``device``, the device it ran on (and the GPU's name for CUDA)."""
    import torch

    meta = dict(
        benchmark=benchmark,
        date=dt.datetime.now().isoformat(timespec="seconds"),
        machine=dict(node=platform.node(), platform=platform.platform(), processor=platform.processor(),
                     python=platform.python_version(), cpus=os.cpu_count(), torch_threads=torch.get_num_threads()),
        torch=torch.__version__,
        command=command_line(),
    )
    if device is not None:
        meta["device"] = device
        if str(device).startswith("cuda") and torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name()
    meta.update(code_version())
    return meta


# --------------------------------------------------------------------------
# child processes
# --------------------------------------------------------------------------
CHILD = "--child"


@dataclass
class Child:
    """What one child process left behind."""

    record: dict | None
    """The JSON record it wrote (``None``: it wrote none that parses)."""
    returncode: int | None
    """Its exit code; ``None`` when it was killed at the timeout."""
    output: str
    """The last 2,000 characters of its stdout and stderr ("" when they were not captured)."""
    seconds: float
    """Wall time from start to exit."""
    timeout: float
    """The timeout it ran under, in seconds."""

    @property
    def failure(self) -> str:
        """Why it left no record: ``timeout after N s`` or ``process exited with code N``."""
        if self.returncode is None:
            return f"timeout after {self.timeout:.0f} s"
        return f"process exited with code {self.returncode}"


def child_env(threads: str | None = None, src_first: bool = False, **extra: str) -> dict:
    """This process's environment for a child: ``OMP_NUM_THREADS`` set to ``threads`` where given (an
    existing setting kept when ``threads`` starts with ``?``), the checkout's ``src/`` first on
    ``PYTHONPATH`` with ``src_first`` (a machine where ckptopt is not installed), and ``extra``."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", threads[1:]) if threads.startswith("?") else threads
    if src_first:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_child(module: str, args: Sequence = (), *, timeout: float, path: str | None = None,
              capture: bool = True, env: dict | None = None) -> Child:
    """Run ``python -m <module> --child PATH *args`` from the repository root and read the record it
    wrote to ``PATH``.

    ``path``: where the record goes (kept); by default a temporary file, removed after reading.
    ``capture``: keep the child's output (its tail is in :attr:`Child.output`) instead of passing it on.
    ``env``: the child's environment (:func:`child_env`), by default this process's.
    """
    keep = path is not None
    if not keep:
        fd, path = tempfile.mkstemp(prefix=module.rsplit(".", 1)[-1] + "_", suffix=".json")
        os.close(fd)
    cmd = [sys.executable, "-m", module, CHILD, path, *map(str, args)]
    pipe = subprocess.PIPE if capture else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=subprocess.STDOUT if capture else None,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        rc = None
    seconds = time.perf_counter() - t0
    try:
        with open(path) as fh:
            record = json.load(fh)
        if not isinstance(record, dict):
            record = None
    except (OSError, ValueError):
        record = None
    finally:
        if not keep and os.path.exists(path):
            os.unlink(path)
    return Child(record=record, returncode=rc, output=(out or "")[-2000:], seconds=seconds, timeout=timeout)


def child_args(argv: Sequence[str] | None = None) -> tuple[str, list[str]] | None:
    """In a process :func:`run_child` started: ``(PATH, ARGS)``; otherwise ``None``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == CHILD:
        return argv[1], argv[2:]
    return None


def write_record(path: str, record: dict) -> None:
    """A child's record (values JSON cannot hold written as strings)."""
    with open(path, "w") as fh:
        json.dump(record, fh, default=str)


def child_record(path: str, fn: Callable[..., dict], *args, **context) -> None:
    """Write ``fn(*args)`` to ``path``; if it raises, ``context`` with the error and its traceback."""
    try:
        record = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - a failing case is recorded, not fatal
        record = dict(context, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
    write_record(path, record)


def cases_in_processes(module: str, cases: list[str], out_dir: str, prefix: str, device: str, timeout: float,
                       extra: tuple = ()) -> Iterator[tuple[str, dict]]:
    """Run each ``MODEL:PLAN`` case as ``python -m module --child PATH MODEL PLAN DEVICE *extra``, all at
    once, each in its own process (``src/`` first on the path, two threads each; their output passed on),
    the records kept in ``out_dir``; yield ``(case, record)`` for each that wrote one without an error, in
    the order given, saying why for the others (timeout, no result, the child's error)."""
    os.makedirs(out_dir, exist_ok=True)
    env = child_env(threads="2", src_first=True)

    def one(case):
        name, plan = case.split(":")
        path = os.path.join(out_dir, f"{prefix}_{name}_{plan}.json")
        return run_child(module, [name, plan, device, *extra], timeout=timeout, path=path, capture=False, env=env)

    with ThreadPoolExecutor(max_workers=max(1, len(cases))) as pool:
        futures = [(case, pool.submit(one, case)) for case in cases]
        for case, future in futures:
            child = future.result()
            if child.returncode is None:
                print(case, "timeout", flush=True)
            elif child.record is None:
                print(case, "no result, exit", child.returncode, flush=True)
            elif "error" in child.record:
                print(case, "ERROR", child.record["error"][:300], flush=True)
            else:
                yield case, child.record


# --------------------------------------------------------------------------
# training steps and batches
# --------------------------------------------------------------------------
def one_step(model, batch: dict, loss_fn: Callable | None = None, seed: int = 1234):
    """Loss and gradients (by parameter name, cloned) of one training step, ``torch.manual_seed(seed)``
    right before the forward; ``loss_fn(output)``, or the model's own ``.loss``. Gradients are cleared
    before and after."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    loss = loss_fn(out) if loss_fn is not None else out.loss
    loss.backward()
    grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def compare_steps(la, ga: dict, lb, gb: dict) -> dict:
    """One step of a rewritten module (loss ``la``, gradients ``ga`` by parameter name) against one of
    the unmodified model (``lb``, ``gb``): the loss difference, the largest gradient difference, the
    parameters whose gradient only one of them has (or of another shape), and whether all are equal."""
    import torch

    worst, identical, missing = 0.0, torch.equal(la, lb), []
    for key, g in gb.items():
        h = ga.get(key)
        if g is None and h is None:
            continue
        if g is None or h is None or g.shape != h.shape:
            missing.append(key)
            continue
        worst = max(worst, (g - h).abs().max().item())
        identical = identical and torch.equal(g, h)
    return dict(loss_ckptopt=la.item(), loss_unmodified=lb.item(), loss_abs_diff=abs(la.item() - lb.item()),
                grad_max_abs_diff=worst, grads_compared=len(gb) - len(missing), grads_missing=missing,
                bit_identical=identical and not missing)


def same_training(module, reference, batch: dict, loss_fn: Callable | None = None) -> dict:
    """One step of ``module`` against one of ``reference`` (a fresh unmodified build; same seed, same
    batch): :func:`compare_steps`, and whether the parameters they share were equal before."""
    import torch

    ref_params = dict(reference.named_parameters())
    params_equal = all(torch.equal(p, ref_params[k]) for k, p in module.named_parameters() if k in ref_params)
    la, ga = one_step(module, batch, loss_fn)
    lb, gb = one_step(reference, batch, loss_fn)
    return {**compare_steps(la, ga, lb, gb), "params_equal_before": params_equal}


def shapes(batch: dict, tensors_only: bool = False) -> dict:
    """Each entry's shape as a list (a value without a shape as it is, or left out with ``tensors_only``)."""
    return {k: list(v.shape) if hasattr(v, "shape") else v for k, v in batch.items()
            if hasattr(v, "shape") or not tensors_only}


def to_device(batch: dict, device: str) -> dict:
    """The batch's tensors moved to ``device`` (other values as they are)."""
    import torch

    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def hf_checkpointing_enable(model) -> None:
    """transformers' own checkpointing of every layer, non-reentrant: ``activation_checkpointing_enable``
    where the model has it (transformers 5), else the deprecated ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def hf_checkpointing_disable(model) -> None:
    """Undo :func:`hf_checkpointing_enable`."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
