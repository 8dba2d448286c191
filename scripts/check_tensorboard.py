#!/usr/bin/env python3
"""Check a run's TensorBoard events against its metrics.jsonl, through the `tensorboard`
package's own readers, so a hand-encoded event file that TensorBoard misreads cannot pass.

usage: python scripts/check_tensorboard.py RUN_DIR

Reads RUN_DIR/tensorboard/ and RUN_DIR/metrics.jsonl and checks, for every metrics line:

    train/loss == loss          train/grad_norm    == grad_norm
    train/lr   == lr            train/tokens_per_s == tokens_per_s
    eval/loss  == eval_loss     (lines that have it)
    memory/rss_mb == rss_mb     (lines that have it)

Values are stored as float32, so each is compared with numpy.float32(json value), exactly (a
JSON null, what serde writes for NaN/inf, must be a non-finite value). Every step appears
exactly once per tag: no duplicate, no missing, no extra step.

Three readers, each of which can hide what another shows:
  1. the record framing, walked with tensorboard's own masked CRC-32C: TensorBoard's loader
     stops silently at a bad or truncated record, so this names the file and byte offset;
  2. event_file_loader.EventFileLoader, event by event (the path the TensorBoard server takes,
     simple_value migrated to a scalar tensor), every file on its own: a step written twice;
  3. event_accumulator.EventAccumulator with no size limit: what the Scalars dashboard shows.

Needs only `pip install tensorboard` (it brings numpy). Exit status: 0 OK, 1 mismatch, 2 usage.
"""

import json
import math
import os
import struct
import sys
from collections import defaultdict

import numpy as np
from tensorboard.backend.event_processing import event_accumulator, event_file_loader, io_wrapper
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.util import tensor_util

# (tag, metrics.jsonl key, present on every line)
TAGS = [
    ("train/loss", "loss", True),
    ("train/lr", "lr", True),
    ("train/grad_norm", "grad_norm", True),
    ("train/tokens_per_s", "tokens_per_s", True),
    ("eval/loss", "eval_loss", False),
    ("memory/rss_mb", "rss_mb", False),
]
MAX_SHOWN = 20


class Problems(list):
    def add(self, msg):
        self.append(msg)


def expected_values(metrics_path, problems):
    """{tag: {step: value or None}} from metrics.jsonl (None: JSON null, i.e. NaN/inf)."""
    want = {tag: {} for tag, _, _ in TAGS}
    steps = []
    with open(metrics_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                m = json.loads(line)
            except json.JSONDecodeError as e:
                problems.add(f"{metrics_path}:{n}: not JSON: {e}")
                continue
            step = m.get("step")
            if not isinstance(step, int):
                problems.add(f"{metrics_path}:{n}: no integer `step`")
                continue
            if step in steps:
                problems.add(f"{metrics_path}:{n}: step {step} appears twice in metrics.jsonl")
            steps.append(step)
            for tag, key, required in TAGS:
                if key in m:
                    want[tag][step] = m[key]
                elif required:
                    problems.add(f"{metrics_path}:{n}: step {step} has no `{key}`")
    return want, steps


def event_files(tb_dir):
    """The event files TensorBoard loads from tb_dir, in the order it loads them."""
    names = sorted(os.listdir(tb_dir))
    return [os.path.join(tb_dir, n) for n in names if io_wrapper.IsTensorFlowEventsFile(n)]


def check_framing(path, problems):
    """Walk the TFRecords of one file; report the first bad one by byte offset."""
    with open(path, "rb") as f:
        data = f.read()
    off = 0
    while off < len(data):
        head = data[off : off + 12]
        if len(head) < 12:
            problems.add(f"{path}: record at byte {off}: truncated header ({len(head)} of 12 bytes)")
            return
        (length,) = struct.unpack("<Q", head[:8])
        (crc,) = struct.unpack("<I", head[8:12])
        if crc != masked_crc32c(head[:8]):
            problems.add(f"{path}: record at byte {off}: length CRC mismatch")
            return
        end = off + 12 + length + 4
        if end > len(data):
            problems.add(f"{path}: record at byte {off}: truncated ({length} payload bytes announced)")
            return
        payload = data[off + 12 : off + 12 + length]
        (crc,) = struct.unpack("<I", data[end - 4 : end])
        if crc != masked_crc32c(payload):
            problems.add(f"{path}: record at byte {off}: payload CRC mismatch")
            return
        off = end


def scalar_of(value):
    """The float of a Summary.Value read through EventFileLoader (migrated to a tensor)."""
    if value.HasField("tensor"):
        return float(tensor_util.make_ndarray(value.tensor).item())
    if value.WhichOneof("value") == "simple_value":
        return float(value.simple_value)
    return None


def same(want, got):
    if want is None:
        return not math.isfinite(got)
    with np.errstate(over="ignore"):
        w = np.float32(want)
    g = np.float32(got)
    return (np.isnan(w) and np.isnan(g)) or w == g


def compare(source, got, want, problems):
    """got: {tag: [(step, value), ...]} as one reader saw it."""
    for tag, _, _ in TAGS:
        by_step = defaultdict(list)
        for step, value in got.get(tag, []):
            by_step[step].append(value)
        for step, values in sorted(by_step.items()):
            if len(values) > 1:
                problems.add(f"{source}: {tag} step {step} appears {len(values)} times: {values}")
            elif step not in want[tag]:
                problems.add(f"{source}: {tag} has step {step}, which metrics.jsonl does not have")
            elif not same(want[tag][step], values[0]):
                w = want[tag][step]
                w32 = "null" if w is None else repr(float(np.float32(w)))
                problems.add(f"{source}: {tag} step {step}: events hold {values[0]!r}, metrics.jsonl {w!r} (float32 {w32})")
        missing = sorted(set(want[tag]) - set(by_step))
        if missing:
            problems.add(f"{source}: {tag} lacks steps {short(missing)} that metrics.jsonl has")


def short(steps):
    return ", ".join(map(str, steps[:10])) + (f", ... ({len(steps)} in all)" if len(steps) > 10 else "")


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    run_dir = argv[1]
    tb_dir = os.path.join(run_dir, "tensorboard")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    for p in (tb_dir, metrics_path):
        if not os.path.exists(p):
            print(f"FAIL: {p} does not exist", file=sys.stderr)
            return 1
    problems = Problems()
    want, steps = expected_values(metrics_path, problems)
    files = event_files(tb_dir)
    if not files:
        problems.add(f"{tb_dir}: no event files (names containing 'tfevents')")

    # 1 + 2: each file's framing, then its events one by one.
    raw = defaultdict(list)
    other_tags = set()
    for path in files:
        check_framing(path, problems)
        for event in event_file_loader.EventFileLoader(path).Load():
            if event.HasField("file_version") and not event.file_version.startswith("brain.Event:"):
                problems.add(f"{path}: unexpected file_version {event.file_version!r}")
            for value in event.summary.value:
                v = scalar_of(value)
                if v is None:
                    problems.add(f"{path}: step {event.step} tag {value.tag}: not a scalar")
                elif value.tag in want:
                    raw[value.tag].append((event.step, v))
                else:
                    other_tags.add(value.tag)
    compare("event files", raw, want, problems)

    # 3: what the dashboard shows.
    acc = event_accumulator.EventAccumulator(tb_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    shown = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    compare("EventAccumulator", shown, want, problems)

    if problems:
        for p in problems[:MAX_SHOWN]:
            print(f"FAIL: {p}", file=sys.stderr)
        if len(problems) > MAX_SHOWN:
            print(f"FAIL: ... {len(problems) - MAX_SHOWN} more", file=sys.stderr)
        return 1
    counts = " ".join(f"{tag}={len(want[tag])}" for tag, _, _ in TAGS)
    span = f"steps {min(steps)}..{max(steps)}" if steps else "no steps"
    extra = f"; other tags not checked: {', '.join(sorted(other_tags))}" if other_tags else ""
    print(f"OK: {tb_dir}: {len(files)} event file(s), {len(steps)} {span}, float32-equal to metrics.jsonl ({counts}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
