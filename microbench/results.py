"""Result files: one JSON document per run, versioned, written atomically, never overwritten.

Schema (``schema = "microbench.result"``, ``schema_version = 1``)::

    {
      "schema": "microbench.result", "schema_version": 1,
      "run": {"id", "started_utc", "finished_utc", "complete": bool, "interrupted": bool,
              "argv", "suite", "cases", "device", "seed", "interleave", "timing": {...},
              "ceilings": {"memory_bandwidth": {"value", "unit", "source"}, ...},
              "summaries": {case id: [{"text", "axes", "variants"}, ...]},  # optional: Case.summarize
              "targets": {case id: [Target.to_dict(), ...]}},  # the bars the cases stated; absent in older files
      "fingerprint": {... microbench.env.fingerprint() ...},
      "records": [ {
          "case", "axes": {...}, "variant", "device", "status": "OK" | "FAILED" | "SKIPPED",
          "reason": str | null,            # why SKIPPED / FAILED
          "correctness": {"passed", "seed", "checked", "reports": [...], "summary"} | null,
          "timing": Measurement.to_dict() | null,   # raw samples in "samples_s"; with --interleave
                                           # sample i of each variant is round i's, "rotation" says
                                           # how their order rotated ("rotations": one per pass),
                                           # "passes" how many rounds each pass of --repeat made
          "bytes", "flops", "gbps", "tflops", "floor_s", "pct_of_floor", "floor_source",
          "clocks": ClockSampler.result() | null,   # NVML during the point
          "probe": {"median_s", "samples_s"} | null, # the environment probe beside the point
          "vs_baseline": Verdict.to_dict() | null,
          "prep_s": float                  # set-up, reference, gate: before timing (not SKIPPED);
                                           # warm-up and capture: timing.warmup_s
      } ]
    }

The file is named ``<UTC time>_<host>_<short sha>.json`` and claimed with an exclusive
create, so two runs never share a name; every later write replaces it atomically
(temporary file + ``os.replace``), so a crash or Ctrl-C leaves the cases finished so far,
marked ``complete: false``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gzip
import json
import math
import os
import re
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

SCHEMA = "microbench.result"
SCHEMA_VERSION = 1
STATUSES = ("OK", "FAILED", "SKIPPED")


class ResultError(ValueError):
    """A result file that cannot be used: unreadable, foreign, or of another schema version."""


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", s).strip("-") or "host"


def result_filename(short_sha: str | None, host: str | None = None, when: _dt.datetime | None = None) -> str:
    when = when or _dt.datetime.now(_dt.timezone.utc)
    return f"{when.strftime('%Y%m%dT%H%M%SZ')}_{_slug(host or socket.gethostname())}_{short_sha or 'nogit'}.json"


def _claim(directory: str, name: str) -> str:
    """Create ``name`` (or name-1, name-2, ...) exclusively; return the path claimed."""
    stem, ext = os.path.splitext(name)
    for i in range(1000):
        path = os.path.join(directory, name if i == 0 else f"{stem}-{i}{ext}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        return path
    raise ResultError(f"{directory}: could not claim a new result file name for {name}")


def write_atomic(path: str, doc: dict[str, Any], indent: int | None = None) -> None:
    """Write JSON to ``path`` through a temporary file in the same folder + os.replace; a
    write that fails (a full disk) leaves the old file and no temporary one.

    Compact separators by default: json's C encoder serves only ``indent=None``, and a GPU
    run's file (hundreds of points, thousands of raw samples each) takes seconds to write
    through the pure-Python one; ``python -m json.tool`` indents a file for reading.
    ``indent``: for small files read by people (a build report).
    """
    directory = os.path.dirname(os.path.abspath(path))
    # before the temporary file: a bad doc leaves none
    text = json.dumps(doc, indent=indent, separators=None if indent else (",", ":"), allow_nan=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp's file is private (0600); the result is not
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


#: Where a run's file goes when its own folder cannot take it (``ResultWriter.close``).
FALLBACK_DIR = os.path.join(tempfile.gettempdir(), "microbench-results")


def _file_mode(path: str) -> int:
    """The permissions ``path`` has (a file being replaced keeps them), else those a new
    file gets under the process's umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class ResultWriter:
    """Owns one result file for one run; ``add`` records and ``flush`` after each point.

    ``flush`` rewrites the whole file, so it writes at most once per ``min_interval_s``
    (or ten times its last write's duration, if longer) unless forced: a long run then
    spends under ~10% of its time writing, and a crash that takes the process down (a
    kill, a segfault) loses at most that window's points: with the default 0.25 s, on a
    GPU (a point takes seconds) the point in progress only. ``close`` (a finished, failed
    or interrupted run) always writes; ``min_interval_s=0`` writes on every flush.

    A write that fails (a full disk, the folder removed) does not stop the run: ``flush``
    says so once on stderr and tries again later; ``close`` remakes the folder, and failing
    that writes the file under the temporary folder (:data:`FALLBACK_DIR`) and says where.
    """

    def __init__(self, out_dir: str, run: dict[str, Any], fingerprint: dict[str, Any], min_interval_s: float = 0.25):
        self.min_interval_s = min_interval_s
        self._next_write = 0.0
        self.write_error: str | None = None  # the last write's failure, None once one succeeds
        os.makedirs(out_dir, exist_ok=True)
        short = (fingerprint.get("git") or {}).get("short")
        host = (fingerprint.get("host") or {}).get("hostname")
        self.path = _claim(out_dir, result_filename(short, host))
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "run": {"complete": False, "interrupted": False, **run},
            "fingerprint": fingerprint,
            "records": [],
        }
        self.flush()

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.doc["records"]

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        self.doc["records"].extend(records)

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_write:
            return
        try:
            write_atomic(self.path, self.doc)
        except OSError as e:
            if self.write_error is None:
                print(f"microbench: cannot write {self.path} ({e.strerror or e}): the run goes on, keeping its "
                      "results to write when it ends", file=sys.stderr, flush=True)
            self.write_error = str(e)
            self._next_write = now + max(self.min_interval_s, 5.0)
            return
        self.write_error = None
        took = time.monotonic() - now
        self._next_write = now + max(self.min_interval_s, 10 * took) if self.min_interval_s > 0 else 0.0

    def close(self, *, complete: bool, interrupted: bool = False, error: str | None = None) -> str | None:
        """Write the file a last time; its path (another one, said on stderr, where that
        one could not be written), or None when no file could be written (said too)."""
        self.doc["run"].update(complete=complete, interrupted=interrupted, finished_utc=utc_now())
        if error:
            self.doc["run"]["error"] = error
        with contextlib.suppress(OSError):  # a folder removed under the run is made again
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.flush(force=True)
        if self.write_error is None:
            return self.path
        try:
            os.makedirs(FALLBACK_DIR, exist_ok=True)
            path = _claim(FALLBACK_DIR, os.path.basename(self.path))
            write_atomic(path, self.doc)
        except (OSError, ResultError) as e:
            print(f"microbench: the results could not be written: {self.path} ({self.write_error}), {FALLBACK_DIR} "
                  f"({e})", file=sys.stderr, flush=True)
            return None
        print(f"microbench: could not write {self.path} ({self.write_error}): the results are in {path}",
              file=sys.stderr, flush=True)
        self.path, self.write_error = path, None
        return path


def load(path: str) -> dict[str, Any]:
    """Read and validate a result file (``.json``, or gzip-compressed as ``gzip`` leaves it);
    raises ResultError with one clear line."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        with (gzip.open(path, "rt") if gz else open(path)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ResultError(f"{path}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ResultError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ResultError(f"{path}: not a JSON result file ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ResultError(f"{path}: not a JSON result file (nested too deeply to read)") from None
    validate(doc, path)
    return doc


def _number(v: Any, positive: bool = False, finite: bool = True) -> bool:
    """A JSON number (not a bool), >= 0, or > 0 with ``positive``; finite unless ``finite``
    is False (never NaN)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and (math.isfinite(v) or not finite)
            and (v > 0 if positive else v >= 0))


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


#: a record's measured numbers: absent or null, else a finite number >= 0
_RECORD_NUMBERS = ("bytes", "flops", "gbps", "tflops", "floor_s", "pct_of_floor", "prep_s")
#: a record's parts that are absent or null, else a JSON object
_RECORD_OBJECTS = ("correctness", "clocks", "probe", "facts", "derived")


def _record_problem(r: dict[str, Any]) -> str | None:
    """What is wrong with one record's parts, as the commands read them (None: nothing)."""
    if not isinstance(r["case"], str) or not isinstance(r["variant"], str):
        return "case and variant must be strings"
    if not isinstance(r["axes"], dict) or not all(
            v is None or isinstance(v, (str, int, float, bool)) for v in r["axes"].values()):
        return "axes must be an object of names to values"
    for k in _RECORD_NUMBERS:
        if r.get(k) is not None and not _number(r[k]):
            return f"{k} {r[k]!r} is not a finite number >= 0"
    for k in _RECORD_OBJECTS:
        if r.get(k) is not None and not isinstance(r[k], dict):
            return f"{k} must be an object"
    for k in ("reason", "floor_source", "baseline", "device"):
        if r.get(k) is not None and not isinstance(r[k], str):
            return f"{k} {r[k]!r} is not a string"
    vb = r.get("vs_baseline")
    if vb is not None and not (isinstance(vb, dict) and isinstance(vb.get("label"), str)
                               and _number(vb.get("ratio"), positive=True)
                               and all(_number(vb.get(b), finite=False) for b in ("lo", "hi"))):
        return "vs_baseline must be an object with a label, a positive ratio, and its lo and hi"
    why = _parts_problem(r)
    if why:
        return why
    t = r.get("timing")
    if t is None:
        # an OK record was timed: every command reads its samples
        return "status OK but no timing" if r["status"] == "OK" else None
    if not isinstance(t, dict):
        return "timing must be an object"
    if not _strings(t.get("notes", [])) or not isinstance(t.get("mode"), (str, type(None))):
        return "timing's notes must be a list of strings and its mode a string"
    samples = t.get("samples_s")
    if not isinstance(samples, list) or not samples:
        return "timing has no samples (samples_s)"
    bad = next((i for i, s in enumerate(samples) if not _number(s, positive=True)), None)
    if bad is not None:
        return f"timing sample {bad} is {samples[bad]!r}: a time must be a finite number > 0"
    s = t.get("summary")
    if not isinstance(s, dict) or not _number(s.get("median"), positive=True):
        return "timing has no positive median (summary.median)"
    if not _count(s.get("count")):
        return f"timing's summary.count {s.get('count')!r} is not a count"
    if not _number(s.get("rel_noise"), finite=False):  # +inf where too few samples bound it (JSON's Infinity)
        return f"timing's summary.rel_noise {s.get('rel_noise')!r} is not a number >= 0"
    for part, v in (("summary.tick", s.get("tick")), ("resolution_s", t.get("resolution_s"))):
        if v is not None and not _number(v):  # absent from files from before ticks were kept
            return f"timing's {part} {v!r} is not a finite number >= 0"
    passes, rotations = t.get("passes"), t.get("rotations")
    if passes is not None and not (isinstance(passes, list) and all(map(_count, passes))
                                   and sum(passes) == len(samples)):
        return f"timing passes {passes!r} do not add up to its {len(samples)} samples"
    if t.get("rotation") is not None and not _count(t["rotation"]):
        return f"timing rotation {t['rotation']!r} is not a count"
    if rotations is not None and not (isinstance(rotations, list) and all(map(_count, rotations))
                                      and len(rotations) == len(passes or [len(samples)])):
        return f"timing rotations {rotations!r} are not one count per pass"
    return None


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _parts_problem(r: dict[str, Any]) -> str | None:
    """What is wrong with the parts compare reads beside the timing: the probe's samples and
    the clocks' figures (None: nothing)."""
    probe = r.get("probe") or {}
    ps = probe.get("samples_s")
    if ps is not None and not (isinstance(ps, list) and ps and all(_number(x, positive=True) for x in ps)):
        return "probe.samples_s must be a list of finite times > 0"
    clocks = r.get("clocks") or {}
    for part in ("sm_clock_mhz", "temperature_c"):
        fig = clocks.get(part)
        if fig is not None and not (isinstance(fig, dict) and all(
                fig.get(k) is None or _number(fig[k]) for k in ("mean", "min", "max"))):
            return f"clocks.{part} must be an object whose mean, min and max are numbers"
    if clocks.get("throttle_reasons") is not None and not _strings(clocks["throttle_reasons"]):
        return "clocks.throttle_reasons must be a list of names"
    return None


def _run_problem(run: dict[str, Any]) -> str | None:
    """What is wrong with the run's parts the tables read (None: nothing)."""
    for k, c in (run.get("ceilings") or {}).items():
        if not (isinstance(c, dict) and _number(c.get("value"), positive=True) and isinstance(c.get("source"), str)):
            return f"run.ceilings.{k} must be an object with a positive value and a source"
    for case, lines in (run.get("summaries") or {}).items():
        if not (isinstance(lines, list) and all(isinstance(x, str) or (isinstance(x, dict) and isinstance(
                x.get("text"), str)) for x in lines)):
            return f"run.summaries.{case} must be a list of lines (strings, or objects with a text)"
    return None


def validate(doc: Any, path: str = "result") -> None:
    """The checks every command's reading relies on: a foreign, other-version or malformed
    document is a ResultError naming what is wrong, not a crash further on."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ResultError(f"{path}: not a microbench result file (no schema {SCHEMA!r})")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ResultError(
            f"{path}: schema version {version!r} but this microbench reads version {SCHEMA_VERSION}"
        )
    if not isinstance(doc.get("records"), list) or not isinstance(doc.get("run"), dict):
        raise ResultError(f"{path}: malformed result file (missing run or records)")
    fp = doc.get("fingerprint", {})
    if not isinstance(fp, dict) or not all(isinstance(fp.get(k), dict) for k in ("device", "software", "git", "host")
                                           if fp.get(k) is not None):
        raise ResultError(f"{path}: malformed result file (the fingerprint, and its device, software, git and "
                          "host parts, must be objects)")
    for k in ("ceilings", "summaries", "targets", "timing", "world"):
        if doc["run"].get(k) is not None and not isinstance(doc["run"][k], dict):
            raise ResultError(f"{path}: malformed result file (run.{k} must be an object)")
    why = _run_problem(doc["run"])
    if why:
        raise ResultError(f"{path}: malformed result file ({why})")
    seen: dict[tuple, int] = {}
    for i, r in enumerate(doc["records"]):
        if not isinstance(r, dict) or not {"case", "axes", "variant", "status"} <= r.keys():
            raise ResultError(f"{path}: record {i} is malformed (needs case, axes, variant, status)")
        if r["status"] not in STATUSES:
            raise ResultError(f"{path}: record {i} has unknown status {r['status']!r}")
        why = _record_problem(r)
        where = " ".join(f"{k}={v}" for k, v in r["axes"].items()) if isinstance(r["axes"], dict) else ""
        if why:
            raise ResultError(f"{path}: record {i} ({r['case']} {where} {r['variant']}) is malformed: {why}")
        # one record per point and variant (a run pools its passes into one): a second would
        # leave compare to pick one of them
        first = seen.setdefault(record_key(r), i)
        if first != i:
            raise ResultError(f"{path}: records {first} and {i} are both {r['case']} {where} {r['variant']}")


def select(docs: Sequence[dict[str, Any]], cases: Sequence[str] = (), variants: Sequence[str] = (),
           axes: Mapping[str, Sequence[str]] | None = None,
           parse: Callable[[str, str, str], Any] | None = None) -> list[dict[str, Any]]:
    """The documents with only the records that match every filter given, for a table to
    paste: ``cases`` ids or dotted prefixes (``moe`` takes ``moe.experts``, ``moe.router``,
    ...), ``variants`` names, ``axes`` {name: values as text}. A name found in none of the
    documents raises ResultError listing what they hold, so a typo is not an empty table;
    each document keeps its own run and fingerprint, and the summary lines about what is
    shown: their case, every axis value they name, one of their variants (a line spanning
    an axis, e.g. tokens, stays when that axis is narrowed). ``parse(case_id, axis, text)``
    reads a value as ``run --axis`` does (``bytes=1K`` is 1024); it may raise for any text
    it does not take."""
    recs = [r for d in docs for r in d["records"]]

    def known(what: str, names: Iterable[str]) -> str:
        names = sorted(set(names))
        return f"{what} in the result file{'s' if len(docs) > 1 else ''}: {', '.join(names) or 'none'}"

    def matches(cid: str, c: str) -> bool:
        return cid == c or cid.startswith(c.rstrip(".") + ".")

    def case_ok(cid: str) -> bool:
        return not cases or any(matches(cid, c) for c in cases)

    for c in cases:
        if not any(matches(r["case"], c) for r in recs):
            raise ResultError(f"--case {c}: no such case; " + known("cases", (r["case"] for r in recs)))
    recs = [r for r in recs if case_ok(r["case"])]
    for v in variants:
        if not any(r["variant"] == v for r in recs):
            raise ResultError(f"--variant {v}: no such variant; " + known("variants", (r["variant"] for r in recs)))
    wanted: dict[str, set[str]] = {}
    for name, values in (axes or {}).items():
        have = {str(r["axes"][name]) for r in recs if name in r["axes"]}
        if not have:
            raise ResultError(f"--axis {name}: no such axis; "
                              + known("axes", (a for r in recs for a in r["axes"])))
        wanted[name] = set()
        for v in values:
            as_read = {v} | ({_parsed(parse, cid, name, v) for cid in {r["case"] for r in recs if name in r["axes"]}}
                             if parse else set())
            if not as_read & have:
                raise ResultError(f"--axis {name}={v}: no such value; " + known(f"{name} values", have))
            wanted[name] |= as_read & have
    axes = wanted

    def keep(r: dict[str, Any]) -> bool:
        return (case_ok(r["case"]) and (not variants or r["variant"] in variants)
                and all(name in r["axes"] and str(r["axes"][name]) in values for name, values in (axes or {}).items()))

    out = []
    for d in docs:
        kept = [r for r in d["records"] if keep(r)]
        run = dict(d["run"])
        if run.get("summaries"):  # a line stays where its case, axis values and variants are shown
            run["summaries"] = {c: [x for x in lines if _shown(x, variants, axes or {})]
                                for c, lines in run["summaries"].items() if case_ok(c)}
        out.append({**d, "run": run, "records": kept})
    if not any(d["records"] for d in out):
        raise ResultError("no record matches --case, --variant and --axis together")
    return out


def _parsed(parse: Callable[[str, str, str], Any], case_id: str, axis: str, text: str) -> str:
    try:
        return str(parse(case_id, axis, text))
    except Exception:  # noqa: BLE001 - a value the case does not read is matched as typed
        return text


def _shown(line: Any, variants: Sequence[str], axes: Mapping[str, Sequence[str]]) -> bool:
    """Whether a summary line (``report.summary``; a plain string is about the whole case)
    is about what a filter shows: every axis value it names, and one of its variants."""
    if not isinstance(line, dict):
        return True
    named = line.get("variants") or []
    return (not variants or not named or any(v in variants for v in named)) and all(
        str(v) in axes[k] for k, v in (line.get("axes") or {}).items() if k in axes)


def record_key(r: dict[str, Any]) -> tuple:
    """Identity of a record across runs: case id, axis values, variant."""
    return (r["case"], tuple(sorted((k, json.dumps(v)) for k, v in r["axes"].items())), r["variant"])
