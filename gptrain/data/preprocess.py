"""``gptrain preprocess``: JSONL -> Megatron ``{prefix}_{key}_document.bin/.idx``, a drop-in for
Megatron-LM's ``tools/preprocess_data.py`` (GPT2BPETokenizer, no sentence splitting).

Work is split in tasks of consecutive lines; a pool of threads parses and tokenizes them (tiktoken
releases the GIL while encoding) and the main thread writes results strictly in input order, so the
bytes written never depend on ``--workers`` or ``--chunk-size``. At most a few tasks are in flight,
so memory stays flat however large the input. Bad lines are skipped and counted, never fatal
unless ``--strict``.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptrain.data.indexed import IndexedDatasetWriter, data_file, index_file, token_dtype
from gptrain.data.jsonl import InputError, expand_inputs, iter_lines
from gptrain.data.provenance import provenance_file, provenance_record
from gptrain.tokenizer import GPT2Tokenizer

# the kinds of bad line, in the order the summary lists them
BAD_KINDS = ("blank", "invalid_utf8", "lone_surrogate", "malformed_json", "not_an_object", "missing_key", "non_string",
             "too_long")
EXAMPLES_PER_KIND = 5
TASK_MIN_BYTES = 256 << 10
TASK_MAX_BYTES = 16 << 20
# a longer line is skipped as too_long: parsing and tokenizing one line takes several times its size
MAX_LINE_BYTES = 256 << 20


class PreprocessError(RuntimeError):
    """A failure the user must fix; the message names the file, line or path at fault."""

    exit_code = 2


@dataclass
class PreprocessConfig:
    inputs: list[str]
    output_prefix: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    vocab_file: str | None = None
    merge_file: str | None = None
    append_eod: bool = False
    workers: int = 1
    chunk_size: int = 64
    log_interval: int = 100000
    strict: bool = False
    overwrite: bool = False
    progress: bool | None = None  # None: a bar only when stderr is a terminal
    max_line_bytes: int = MAX_LINE_BYTES

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("--input: give at least one JSONL file or glob")
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be at least 1, got {self.chunk_size}")
        if not self.json_keys:
            raise ValueError("--json-keys: give at least one key")

    def output_prefixes(self) -> dict[str, str]:
        return {key: f"{self.output_prefix}_{key}_document" for key in self.json_keys}


@dataclass
class Task:
    file_index: int
    first_line: int  # 1-based line number of lines[0]
    lines: list[bytes | None]  # None: a line over max_line_bytes, skipped unread


@dataclass
class TaskResult:
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    documents: int
    bytes: int
    bad: list[tuple[str, int]]  # (kind, line number)


@dataclass
class Report:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bad_counts: dict[str, int] = field(default_factory=dict)
    bad_examples: dict[str, list[str]] = field(default_factory=dict)

    def add_bad(self, kind: str, where: str) -> None:
        self.bad_counts[kind] = self.bad_counts.get(kind, 0) + 1
        examples = self.bad_examples.setdefault(kind, [])
        if len(examples) < EXAMPLES_PER_KIND:
            examples.append(where)

    @property
    def skipped(self) -> int:
        return sum(self.bad_counts.values())

    def summary(self) -> str:
        mb = self.bytes / 1e6
        rate = mb / self.seconds if self.seconds > 0 else float("inf")
        line = (
            f"done: {self.documents} documents, {self.tokens} tokens from {mb:.1f} MB in {self.seconds:.1f} s "
            f"({rate:.2f} MB/s, {self.tokens / max(self.seconds, 1e-9) / 1e6:.2f} M tokens/s)"
        )
        if self.skipped:
            parts = []
            for kind in BAD_KINDS:
                if kind in self.bad_counts:
                    where = ", ".join(self.bad_examples[kind])
                    more = " ..." if self.bad_counts[kind] > len(self.bad_examples[kind]) else ""
                    parts.append(f"{kind}: {self.bad_counts[kind]} [{where}{more}]")
            line += f"; skipped {self.skipped} lines ({'; '.join(parts)})"
        return line


def _parse_int(digits: str):
    # Python refuses int() of more than 4300 digits; such a value is never a document's text,
    # so a float (inf for huge ones) keeps the line parseable
    return int(digits) if len(digits) < 4000 else float(digits)


def _classify_and_encode(task: Task, keys: list[str], tokenizer: GPT2Tokenizer, append_eod: bool) -> TaskResult:
    """Parse and tokenize one task's lines (runs in a worker thread)."""
    tokens: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    lengths: dict[str, list[int]] = {k: [] for k in keys}
    bad: list[tuple[str, int]] = []
    eod = np.array([tokenizer.eod], dtype=np.uint32)
    documents = 0
    nbytes = 0
    for offset, raw in enumerate(task.lines):
        line_no = task.first_line + offset
        if raw is None:
            bad.append(("too_long", line_no))
            continue
        nbytes += len(raw)
        if not raw.strip():
            bad.append(("blank", line_no))
            continue
        try:
            text_line = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(("invalid_utf8", line_no))
            continue
        try:
            record = json.loads(text_line, parse_int=_parse_int)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            bad.append(("malformed_json", line_no))
            continue
        if not isinstance(record, dict):
            bad.append(("not_an_object", line_no))
            continue
        missing = [k for k in keys if k not in record]
        if missing:
            bad.append(("missing_key", line_no))
            continue
        if not all(isinstance(record[k], str) for k in keys):
            bad.append(("non_string", line_no))
            continue
        try:
            encoded = [tokenizer.encode_array(record[k]) for k in keys]
        except UnicodeEncodeError:  # valid bytes, but a JSON escape such as "\ud800" is a lone surrogate
            bad.append(("lone_surrogate", line_no))
            continue
        for key, ids in zip(keys, encoded):
            # Megatron appends the end-of-document token only to non-empty documents
            if append_eod and ids.size:
                ids = np.concatenate([ids, eod])
            tokens[key].append(ids)
            lengths[key].append(ids.size)
        documents += 1
    return TaskResult(
        tokens={k: np.concatenate(v) if v else np.zeros(0, np.uint32) for k, v in tokens.items()},
        lengths={k: np.asarray(v, dtype=np.int64) for k, v in lengths.items()},
        documents=documents,
        bytes=nbytes,
        bad=bad,
    )


def _iter_tasks(files: list[Path], chunk_size: int, counters: list, max_line_bytes: int):
    for file_index, path in enumerate(files):
        lines: list[bytes | None] = []
        size = 0
        first = 1
        line_no = 0
        for line_no, raw in enumerate(iter_lines(path, counters, max_line_bytes), start=1):
            lines.append(raw)
            size += len(raw) if raw is not None else 0
            if (len(lines) >= chunk_size and size >= TASK_MIN_BYTES) or size >= TASK_MAX_BYTES:
                yield Task(file_index, first, lines)
                lines, size, first = [], 0, line_no + 1
        if lines:
            yield Task(file_index, first, lines)


def _check_outputs(config: PreprocessConfig) -> None:
    parent = Path(config.output_prefix).parent
    if not parent.exists():
        raise PreprocessError(f"--output-prefix {config.output_prefix}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise PreprocessError(f"--output-prefix {config.output_prefix}: directory {parent} is not writable")
    if config.overwrite:
        return
    for prefix in config.output_prefixes().values():
        for path in (data_file(prefix), index_file(prefix), provenance_file(prefix)):
            if path.exists():
                raise PreprocessError(f"{path} already exists: pass --overwrite to replace it, or choose another --output-prefix")


class _Progress:
    """A tqdm bar on a terminal; Megatron-style 'Processed N documents' lines otherwise."""

    def __init__(self, total_bytes: int, enabled: bool | None, log_interval: int):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.log_interval = log_interval
        self.next_log = log_interval
        self.start = time.perf_counter()
        self.bar = None
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess",
                            mininterval=0.5, dynamic_ncols=True)

    def update(self, read_bytes: int, report: Report) -> None:
        if self.bar is not None:
            self.bar.n = read_bytes
            self.bar.set_postfix(docs=report.documents, tokens=report.tokens, refresh=False)
            self.bar.refresh()
        elif report.documents >= self.next_log:
            elapsed = time.perf_counter() - self.start
            print(f"Processed {report.documents} documents ({report.documents / elapsed:.2f} docs/s, "
                  f"{report.bytes / elapsed / 1e6:.2f} MB/s, {report.tokens} tokens).", file=sys.stderr, flush=True)
            while self.next_log <= report.documents:
                self.next_log += self.log_interval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Interrupted(PreprocessError):
    """SIGINT or SIGTERM arrived: temporary files were removed, nothing was published."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: no output was written "
                         "(temporary files removed)")


@contextmanager
def _signals_raise():
    """SIGINT/SIGTERM raise ``Interrupted`` in the main thread, so the cleanup below runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def preprocess(config: PreprocessConfig, tokenizer: GPT2Tokenizer | None = None) -> Report:
    """Run the whole conversion; raise ``PreprocessError`` (nothing left behind) on fatal problems."""
    try:
        files = expand_inputs(config.inputs)
    except OSError as err:
        raise PreprocessError(str(err)) from None
    _check_outputs(config)
    tokenizer = tokenizer or GPT2Tokenizer(config.vocab_file, config.merge_file)
    # from the largest id, not the vocabulary's length: an eod id past it must still fit
    dtype = token_dtype(max(tokenizer.vocab_size, tokenizer.max_id + 1))
    prefixes = config.output_prefixes()
    report = Report()
    counters: list = []
    total_bytes = sum(p.stat().st_size for p in files)
    with _signals_raise():
        writers: dict[str, IndexedDatasetWriter] = {}
        progress = None
        try:
            for key, prefix in prefixes.items():
                writers[key] = IndexedDatasetWriter(prefix, dtype)
            progress = _Progress(total_bytes, config.progress, config.log_interval)
            start = time.perf_counter()
            _convert(config, files, tokenizer, writers, report, counters, progress)
            report.seconds = time.perf_counter() - start
            if report.documents == 0:
                kinds = ", ".join(f"{k}: {n}" for k, n in report.bad_counts.items()) or "the input is empty"
                raise PreprocessError(f"no documents in {', '.join(map(str, files))} ({report.skipped} lines "
                                      f"skipped; {kinds}): nothing written")
            for key, prefix in prefixes.items():
                writers[key].finalize(provenance_record(tokenizer.describe(), inputs=files, counts={
                    "documents": report.documents,
                    "tokens": int(writers[key].tokens),
                    "skipped_lines": dict(report.bad_counts),
                }, extra={"json_key": key, "append_eod": config.append_eod}))
        except OSError as err:
            for writer in writers.values():
                writer.abort()
            if err.errno == errno.ENOSPC:
                raise PreprocessError(f"no space left on device writing {config.output_prefix}*: free space and run "
                                      "again (no output was left behind)") from None
            raise PreprocessError(f"{err.filename or config.output_prefix}: {err.strerror or err}") from None
        except InputError as err:
            for writer in writers.values():
                writer.abort()
            raise PreprocessError(f"{err} (nothing written)") from None
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        finally:
            if progress is not None:
                progress.close()
    return report


def _convert(config: PreprocessConfig, files: list[Path], tokenizer, writers: dict, report: Report, counters: list,
             progress: _Progress) -> None:
    """Tokenize in the pool, write in input order."""
    with ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="tokenize") as pool:
        pending: deque = deque()
        tasks = _iter_tasks(files, config.chunk_size, counters, config.max_line_bytes)

        def drain_one():
            task, future = pending.popleft()
            result = future.result()
            for kind, line_no in result.bad:
                where = f"{files[task.file_index]}:{line_no}"
                if config.strict:
                    raise PreprocessError(f"{where}: {kind.replace('_', ' ')} (--strict stops at the first bad line)")
                report.add_bad(kind, where)
            for key, writer in writers.items():
                writer.add_documents(result.tokens[key], result.lengths[key])
            report.documents += result.documents
            report.tokens += int(result.tokens[config.json_keys[0]].size)
            report.bytes += result.bytes
            progress.update(sum(c.bytes_read for c in counters), report)

        try:
            for task in tasks:
                pending.append((task, pool.submit(_classify_and_encode, task, config.json_keys, tokenizer,
                                                  config.append_eod)))
                # bounded look-ahead keeps memory flat whatever the input size
                while len(pending) > 2 * config.workers + 2:
                    drain_one()
            while pending:
                drain_one()
        except BaseException:
            for _, future in pending:  # do not wait for queued work on the way out
                future.cancel()
            raise
