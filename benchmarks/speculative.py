"""Speculative decoding on the trained pair (backends/tiny/trained.py), side by side in one run:
the hub over HTTP, the same target served with and without speculation.

Workloads (held-out standard-library code as prompts, greedy, `ignore_eos`, streamed):
- `one_stream`: one request at a time, code prompts of about 96 tokens continued for 128;
  the target alone against the target with its draft model (`speculative: {draft}`).
- `copy`: one request at a time, a code chunk followed by its first line again, continued for
  as many tokens as the chunk (the model rewrites code it was given): the target alone
  against prompt lookup (`speculative: {method: "ngram"}`).
- `concurrent`: 64 requests of 32-192 prompt and output tokens, 32 streams at once: the
  target alone, with its draft and with prompt lookup.

One `hub serve` holds every arm: `target` and `draft` as registered versions, and each
speculative arm as another version of the target folder registered with its runtime config
through the admin API; a hub that refuses the config is reported arm by arm (the runs
without speculation still complete) and the script exits with status 2. Acceptance comes
from the hub's `/metrics` (`hub_llm_spec_*`, counted per arm over each phase). The one-stream
workloads run their arms in turn request by request (`llm_peers.run_interleaved`: request i
on each arm, the order rotated each request), so that the machine's drift during a phase
falls on every arm alike; `concurrent` runs one arm at a time. `--rounds` rounds, the order
rotated each round; medians are reported, with
each speculative arm's tokens/s over the plain target's taken per round, and how many
greedy answers were the same text as the plain target's (speculation must not change them).
With llama.cpp's `llama-server` at hand (see `llm_peers.py`), `one_stream` also runs on it,
without and with the draft (`--model-draft`, `--spec-type draft-simple`, the pair converted
to GGUF F32; its drafted and accepted tokens read from its log). Results go to
`benchmarks/results/speculative.json` and `.png`; `--quick` is a smoke run on the quick pair.

    python benchmarks/speculative.py [--quick] [--rounds N] [--num-tokens K]
        [--llama-server PATH] [--converter PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from backends.runtime_config import SpeculativeConfig  # noqa: E402
from benchmarks import peer_servers  # noqa: E402
from benchmarks.launch.process import hub_config, hub_process  # noqa: E402
from benchmarks.llm_peers import CACHE, Request, run_interleaved, run_phase  # noqa: E402
from benchmarks.peer_servers import Endpoint, PeerMissing  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ENGINE = {"kv_cache_bytes": "256MiB", "max_num_seqs": 64, "max_num_batched_tokens": 512}
# Which arms each workload compares; the first is the baseline.
WORKLOADS = {
    "one_stream": ("target", "target-draft"),
    "copy": ("target", "target-ngram"),
    "concurrent": ("target", "target-draft", "target-ngram"),
}
CONCURRENCY = {"one_stream": 1, "copy": 1, "concurrent": 32}


def speculative_configs(k: int) -> dict[str, dict[str, Any]]:
    """Runtime config of each speculative arm, as another version of the target folder."""
    return {
        "target-draft": {**ENGINE, "speculative": {"draft": "draft@1", "num_tokens": k}},
        "target-ngram": {
            **ENGINE,
            "speculative": {"method": "ngram", "num_tokens": k, "min_match": 1, "max_match": 3},
        },
    }


def code_chunks(texts: list[str], rng: random.Random, count: int) -> list[str]:
    """`count` runs of whole lines from random places in the held-out files."""
    out = []
    while len(out) < count:
        lines = rng.choice(texts).splitlines(keepends=True)
        if len(lines) < 60:
            continue
        start = rng.randrange(0, len(lines) - 50)
        chunk = "".join(lines[start : start + 50])
        if chunk.strip():
            out.append(chunk)
    return out


def workloads(tokenizer: Any, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The requests of each workload (the same every round)."""
    rng = random.Random(args.seed)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    n1, nc = (2, 8) if args.quick else (8, 64)
    out: dict[str, list[Request]] = {"one_stream": [], "copy": [], "concurrent": []}
    for chunk in code_chunks(texts, rng, n1):
        out["one_stream"].append(Request(encode(chunk)[:96], "", 32 if args.quick else 128))
    for chunk in code_chunks(texts, rng, n1):
        body = encode(chunk)[:160]
        text = tokenizer.decode(body)
        first = text.splitlines(keepends=True)[0]
        prompt = encode(f"{text}\n\n{first}")
        out["copy"].append(Request(prompt, "", max(16, len(body) - len(encode(first)))))
    for chunk in code_chunks(texts, rng, nc):
        p, o = rng.randint(32, 192), rng.randint(32, 192)
        out["concurrent"].append(Request(encode(chunk)[:p], "", 32 if args.quick else o))
    return out


def spec_counters(base: str, model: str) -> dict[str, float]:
    """This model's `hub_llm_spec_*` samples from `/metrics` (by position where labelled)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("hub_llm_spec_") and s.labels.get("model") == model:
                if s.name.endswith("_created"):
                    continue
                key = s.name + (f"@{s.labels['position']}" if "position" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Proposed and accepted drafts over a phase, the rate overall and by position, and
    tokens emitted per verifying target step."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def get(name: str) -> float:
        return d.get(f"hub_llm_spec_{name}_total", 0.0)

    proposed, accepted = get("draft_tokens"), get("accepted_tokens")
    by_position = {}
    for key, value in sorted(d.items()):
        if key.startswith("hub_llm_spec_accepted_by_position") and "@" in key:
            pos = key.split("@")[1]
            tried = d.get(f"hub_llm_spec_draft_tokens_by_position_total@{pos}", 0.0)
            by_position[pos] = round(value / tried, 4) if tried else None
    steps = get("verify_steps")
    return {
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "acceptance_by_position": by_position,
        "tokens_per_target_step": round(get("emitted_tokens") / steps, 3) if steps else None,
    }


def register_arms(base: str, pair: Any, k: int) -> dict[str, str]:
    """Register each speculative arm; the arms the hub refused, with its answer."""
    import httpx

    refused = {}
    with httpx.Client(base_url=base, timeout=600) as c:
        for name, config in speculative_configs(k).items():
            body = {"name": name, "kind": "llm", "source": str(pair.target), "config": config}
            r = c.post("/admin/registry/models", json=body)
            if r.status_code < 400:
                r = c.post(f"/admin/models/{name}/versions/1/load")
            if r.status_code >= 400:
                try:
                    why = str(r.json()["error"]["message"])
                except (ValueError, KeyError, TypeError):
                    why = r.text
                refused[name] = f"{r.status_code}: {why[:200]}"
                tqdm.write(f"the hub refused {name} ({config['speculative']}): {refused[name]}")
    return refused


def measure_hub(args: argparse.Namespace, pair: Any, work: dict[str, Any], root: Path) -> Any:
    """Every workload and arm on one hub, `args.rounds` rounds; (rounds, refused arms)."""
    models = [
        {"name": name, "kind": "llm", "source": str(folder), "preload": True, "config": ENGINE}
        for name, folder in (("target", pair.target), ("draft", pair.draft))
    ]
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    rounds: list[dict[str, Any]] = []
    with hub_process(hub_config(root, models), cwd=root, env=env, timeout=300) as (base, proc):
        refused = register_arms(base, pair, args.num_tokens)
        fields = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        ep = Endpoint("hub", base, proc.pid, "target", False, lambda n: fields)
        # Every arm answers each workload's first request once before anything is timed:
        # the first requests of a fresh hub run slower (lazy set-up), whichever arm gets them.
        for name, arms in WORKLOADS.items():
            for arm in arms:
                if arm not in refused:
                    warm = dataclasses.replace(ep, model=arm)
                    asyncio.run(run_phase(warm, work[name][:1], 1))
        steps = args.rounds * sum(len(a) for a in WORKLOADS.values())
        with tqdm(total=steps, desc="phases") as bar:
            for rnd in range(args.rounds):
                measured: dict[str, Any] = {}
                for name, arms in WORKLOADS.items():
                    order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
                    live = [arm for arm in order if arm not in refused]
                    if CONCURRENCY[name] == 1 and len(live) > 1:
                        # One stream: the arms take turns request by request, so a change
                        # of the machine's speed during the phase falls on all of them.
                        bar.set_postfix_str(f"round {rnd + 1}: {name}, arms in turn")
                        bar.update(len(order))
                        counted = {arm: spec_counters(base, arm) for arm in live}
                        eps = [dataclasses.replace(ep, name=arm, model=arm) for arm in live]
                        phases = asyncio.run(run_interleaved(eps, work[name]))
                        for arm in live:
                            phase = phases[arm]
                            after = spec_counters(base, arm)
                            phase["speculation"] = acceptance(counted[arm], after)
                            measured.setdefault(name, {})[arm] = phase
                            _report(rnd, name, arm, phase)
                        continue
                    for arm in order:
                        bar.set_postfix_str(f"round {rnd + 1}: {name} on {arm}")
                        bar.update()
                        if arm in refused:
                            continue
                        arm_ep = dataclasses.replace(ep, model=arm)
                        before = spec_counters(base, arm)
                        phase = asyncio.run(run_phase(arm_ep, work[name], CONCURRENCY[name]))
                        phase["speculation"] = acceptance(before, spec_counters(base, arm))
                        measured.setdefault(name, {})[arm] = phase
                        _report(rnd, name, arm, phase)
                rounds.append(measured)
    return rounds, refused


def _report(rnd: int, name: str, arm: str, phase: dict[str, Any]) -> None:
    tqdm.write(f"round {rnd + 1} {name} {arm}: {phase['tokens_per_s']:.0f} tok/s, ITL p50 "
               f"{phase['itl_p50_ms']:.2f} ms, acceptance "
               f"{phase['speculation']['acceptance_rate']}"
               + (" (arms in turn)" if phase.get("interleaved") else ""))  # fmt: skip


def measure_llama_cpp(args: argparse.Namespace, pair: Any, work: dict[str, Any], root: Path) -> Any:
    """`one_stream` on llama-server without and with `--model-draft`; None when missing."""
    try:
        binary = peer_servers.find_llama_server(args.llama_server, CACHE)
        target = peer_servers.ensure_gguf(pair.target, args.converter, CACHE)
        draft = peer_servers.ensure_gguf(pair.draft, args.converter, CACHE)
    except PeerMissing as e:
        tqdm.write(f"llama.cpp skipped: {e}")
        return None
    # The draft flags of llama.cpp builds from 2026 on (`--draft-max` / `--draft-min` left).
    # Their `--model-draft` alone only loads the draft: a plain draft model drafts with
    # `--spec-type draft-simple` (else the type is read from the draft's GGUF metadata, which
    # a converted Hugging Face model lacks, and nothing is drafted). Drafting stops below the
    # same probability as the hub's drafts do (`min_draft_probability`, llama.cpp's p_min).
    p_min = SpeculativeConfig(draft="draft@1").min_draft_probability
    draft_args = ["--model-draft", str(draft), "--spec-type", "draft-simple",
                  "--spec-draft-n-max", str(args.num_tokens), "--spec-draft-n-min", "0",
                  "--spec-draft-p-min", str(p_min), "-td", str(args.threads)]  # fmt: skip
    out: dict[str, Any] = {"version": peer_servers.llama_version(binary), "draft_p_min": p_min}
    for rnd in range(args.rounds):
        for arm, extra in (("llama.cpp", []), ("llama.cpp-draft", draft_args)):
            try:
                with peer_servers.llama_server(binary, target, root, args.threads, extra) as ep:
                    asyncio.run(run_phase(ep, [work["one_stream"][0]], 1))
                    phase = asyncio.run(run_phase(ep, work["one_stream"], 1))
                if extra:
                    phase["speculation"] = llama_drafts(root / "llama-server.log")
                    if not phase["speculation"]["proposed"]:
                        raise RuntimeError("llama-server drafted nothing: speculation was off")
            except (RuntimeError, TimeoutError) as e:  # the hub's figures are kept
                tqdm.write(f"llama.cpp arm {arm} failed: {str(e)[-400:]}")
                out.setdefault("failed", {})[arm] = str(e)[-400:]
                continue
            out.setdefault(arm, []).append(phase)
            tqdm.write(f"round {rnd + 1} one_stream {arm}: {phase['tokens_per_s']:.0f} tok/s")
    return out


def llama_drafts(log: Path) -> dict[str, Any]:
    """Drafted and accepted tokens of a llama-server run, from the line its log prints as a
    request that drafted ends ("task T | draft acceptance = r ( a accepted / g generated)"),
    the warm-up request's left out: the task of the first timing line (every request prints
    its prompt's timing)."""
    text = log.read_text(errors="replace")
    first = re.search(r"task (\d+) \| prompt eval time", text)
    warm_up = first.group(1) if first else None
    pattern = r"task (\d+) \| draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated"
    counts = [
        (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(pattern, text)
        if m.group(1) != warm_up
    ]
    accepted, proposed = sum(a for a, _ in counts), sum(g for _, g in counts)
    rate = round(accepted / proposed, 4) if proposed else None
    return {"proposed": proposed, "accepted": accepted, "acceptance_rate": rate}


def summarize(rounds: list[dict[str, Any]], llama: dict[str, Any] | None) -> dict[str, Any]:
    """Medians per workload and arm, each speculative arm's per-round speed-up over the
    plain target, and how many of its answers were the plain target's text."""
    keys = ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")
    out: dict[str, Any] = {}
    for name, arms in WORKLOADS.items():
        for arm in arms:
            runs = [r[name][arm] for r in rounds if arm in r.get(name, {})]
            if not runs:
                continue
            entry = {k: statistics.median(run[k] for run in runs) for k in keys}
            entry["acceptance_rate"] = runs[-1]["speculation"]["acceptance_rate"]
            entry["speculation"] = runs[-1]["speculation"]
            if arm != arms[0] and not any(r["speculation"]["proposed"] for r in runs):
                # Not an error: speculation turns itself off (large batches, low acceptance).
                entry["note"] = "no drafts counted: speculation was off in this workload"
            if arm != arms[0]:
                base = [r[name][arms[0]] for r in rounds]
                pairs = list(zip(runs, base, strict=True))
                per_round = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs]
                same = sum(x == y for r, b in pairs
                           for x, y in zip(r["texts"], b["texts"], strict=True))  # fmt: skip
                entry["speedup"] = statistics.median(per_round)
                entry["speedup_rounds"] = per_round
                entry["same_text_as_plain"] = f"{same}/{sum(len(r['texts']) for r in runs)}"
            out.setdefault(name, {})[arm] = entry
    if llama:
        for arm in ("llama.cpp", "llama.cpp-draft"):
            if llama.get(arm):
                out["one_stream"][arm] = {
                    k: statistics.median(run[k] for run in llama[arm]) for k in keys
                }
                if "speculation" in llama[arm][-1]:
                    speculation = llama[arm][-1]["speculation"]
                    out["one_stream"][arm]["acceptance_rate"] = speculation["acceptance_rate"]
                    out["one_stream"][arm]["speculation"] = speculation
        hub = out["one_stream"].get("target-draft")
        if hub and "llama.cpp-draft" in out["one_stream"]:
            hub["over_llama_cpp_draft"] = (
                hub["tokens_per_s"] / out["one_stream"]["llama.cpp-draft"]["tokens_per_s"]
            )
    for measured in rounds:
        for phases in measured.values():
            for phase in phases.values():
                phase.pop("texts", None)
    for phases in (llama or {}).values():
        for phase in phases if isinstance(phases, list) else []:
            phase.pop("texts", None)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 4.5), squeeze=False)
    for ax, (name, arms) in zip(axes[0], summary.items(), strict=True):
        bars = ax.bar(list(arms), [a["tokens_per_s"] for a in arms.values()],
                      color=["#999999"] + ["#1f77b4"] * (len(arms) - 1))  # fmt: skip
        labels = [f"{a['tokens_per_s']:.0f}" + (f"\n{a['speedup']:.2f}x" if "speedup" in a else "")
                  + (f"\nacc {a['acceptance_rate']:.2f}" if a.get("acceptance_rate") else "")
                  for a in arms.values()]  # fmt: skip
        ax.bar_label(bars, labels, fontsize=8)
        ax.set_ylim(0, 1.3 * max(a["tokens_per_s"] for a in arms.values()))  # label room
        ax.set_title(f"{name} (concurrency {CONCURRENCY[name]})")
        ax.set_ylabel("output tokens / s")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"speculative decoding on the trained pair ({results['pair']['name']}), "
                 f"k={results['num_tokens']}, {results['threads']} threads, "
                 f"{results['rounds']} rounds (medians)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick pair, few requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step (k)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's server binary")
    parser.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        args.rounds = 1
        if args.out == RESULTS / "speculative.json":
            args.out = RESULTS / "speculative-quick.json"

    from transformers import AutoTokenizer

    from backends.tiny.stdlib_corpus import stdlib_corpus
    from backends.tiny.trained import BENCHMARK_PAIR, QUICK_PAIR, build_trained_pair

    spec = QUICK_PAIR if args.quick else BENCHMARK_PAIR
    pair = build_trained_pair(spec)
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    held_out = stdlib_corpus(spec.train_chars, spec.held_out_chars).held_out
    work = workloads(tokenizer, held_out, args)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="speculative-") as tmp:
        rounds, refused = measure_hub(args, pair, work, Path(tmp))
        llama = measure_llama_cpp(args, pair, work, Path(tmp))
    results = {
        "pair": {"name": spec.name, **{k: v for k, v in pair.report.items() if k != "spec"}},
        "num_tokens": args.num_tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "workload": {
            name: {
                "concurrency": CONCURRENCY[name],
                "requests": len(reqs),
                "prompt_tokens": [len(r.prompt) for r in reqs],
                "output_tokens": [r.max_tokens for r in reqs],
            }
            for name, reqs in work.items()
        },
        "refused": refused,
        "llama_cpp_version": llama["version"] if llama else None,
        "llama_cpp_failed": llama.get("failed") if llama else None,
        "summary": summarize(rounds, llama),
        "rounds_raw": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps(results["summary"], indent=2))
    if refused:
        print(
            "the hub refused speculative decoding for "
            + ", ".join(f"{arm} ({why})" for arm, why in refused.items())
            + ": the runs without speculation are in the results; this hub has no "
            "speculative decoding yet (or the config above is wrong)",
            file=sys.stderr,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
