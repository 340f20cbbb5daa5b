"""What `bench.py --workload spec` prints (benchmarks/spec.py): each workload's table, the targets, vLLM."""
from __future__ import annotations

from pathlib import Path

SAME = ("  acc len: mean acceptance length, tokens a verify step emits (1 + accepted / drafts); acc rate: drafts "
        "accepted / drafts; = off: greedy outputs equal to off's token for token")


def _f(x, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{fmt}}"


def _row(y: dict) -> str:
    """out tok/s, speedup, acc len, acc rate, = off of one run."""
    same = f"{y['identical_to_off']}/{y['num_requests']}" if "identical_to_off" in y else "-"
    return (f"{y['output_tokens_per_s']:>10.1f}{_f(y.get('speedup_vs_off'), '.2f', 8)}x"
            f"{_f(y['mean_acceptance_length'], '.2f', 9)}{_f(y['draft_acceptance_rate'], '.1%', 9)}{same:>7}")


HEAD = f"{'out tok/s':>10}{'speedup':>9}{'acc len':>9}{'acc rate':>9}{'= off':>7}"


def print_spec(r: dict) -> None:
    s = r["settings"]
    print(f"\nspeculative decoding: model {Path(s['model']).name}, {s['threads']} torch threads, greedy; "
          f"n-gram prompt_lookup_max {s['prompt_lookup_max']}, min {s['prompt_lookup_min']}; suffix: vLLM's defaults, "
          f"k as given; draft model: {s['draft_note']}; drafts per step: {s['draft_policy']}")
    if "repeating" in r:
        print_repeating(r)
    if "agent" in r:
        print_agent(r["agent"])
    if "json" in r:
        print_json(r["json"])
    if "trace" in r:
        print_trace(r["trace"])
    print()
    for t in r["targets"].values():
        value = "not run" if t["value"] is None else f"{t['value']:.2f}x ({t['of']})"
        print(f"target: {t['what']} >= {t['target']}x: {value}: {'met' if t['met'] else 'missed'}")
    v = r.get("peers", {}).get("vllm")
    if v is not None:
        print_vllm(v)


def print_repeating(r: dict) -> None:
    s, rep = r["settings"], r["repeating"]
    n = s["num_prompts"]
    max_tokens = s["max_tokens"] or f"passage tokens + {s['max_tokens_slack']}"
    kinds = {}
    for p in r["prompts"]:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    print(f"\nrepeating: {n} chat prompts ({', '.join(f'{v} {k}' for k, v in kinds.items())}) over passages of "
          f"{r['passage_tokens'][0]}-{r['passage_tokens'][1]} tokens of {', '.join(s['texts'])}; stops at EOS, "
          f"max_tokens {max_tokens}; prefix caching off")
    print(f"\n{'one request at a time':26}{HEAD}")
    for x in rep["configs"].values():
        print(f"{x['label']:26}" + (f" failed: {x['error']}" if "error" in x else _row(x["concurrency"]["1"])))
    print(SAME)
    levels = [c for c in rep["concurrency"] if c > 1]
    if levels:
        print(f"\n{'at once: out tok/s (x off)':26}" + "".join(f"{f'{c} at once':>18}" for c in levels))
        for x in rep["configs"].values():
            if "error" not in x:
                print(f"{x['label']:26}" + "".join(
                    f"{x['concurrency'][str(c)]['output_tokens_per_s']:>10.1f} ("
                    f"{_f(x['concurrency'][str(c)].get('speedup_vs_off'), '.2f', 4)}x)" for c in levels))
        print(f"  drafts per step: {s['draft_policy']}")
    for x in rep["configs"].values():
        diffs = {c: y["first_differences"] for c, y in x.get("concurrency", {}).items() if y.get("first_differences")}
        if diffs:
            print(f"  {x['label']}: outputs that differ from off's first differ at output token "
                  + "; ".join(f"{c} at once: {', '.join(map(str, d))}" for c, d in diffs.items()))
    if "copies" in rep:
        same = ", ".join(f"{c} at once {v}/{n}" for c, v in rep["off_batched_identical_to_one_at_a_time"].items()
                         if c != "1")
        print(f"  off's answers equal to the passage: {', '.join(f'{k} {v}' for k, v in rep['copies'].items())} "
              f"(of {', '.join(f'{v} {k}' for k, v in kinds.items())}); off = off one at a time: {same or '-'}")


def print_agent(a: dict) -> None:
    s = a["settings"]
    print(f"\nagent: one tool call asked {s['num_prompts']} times with another city, date and unit, one request at a "
          f"time in order on one engine; prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens (system "
          f"prompt, tool schema, one worked exchange), answers as taught {s['expected_answer_tokens'][0]}-"
          f"{s['expected_answer_tokens'][1]} tokens, max_tokens {s['max_tokens']}; prefix caching on")
    print(f"{'configuration':26}{HEAD}{'first req':>11}{'the rest':>10}")
    for x in a["configs"].values():
        if "error" in x:
            print(f"{x['label']:26} failed: {x['error']}")
            continue
        fr = x["first_and_rest"]
        print(f"{x['label']:26}{_row(x['concurrency']['1'])}{fr['first_tokens_per_s']:>11.1f}"
              f"{_f(fr['rest_tokens_per_s'], '.1f', 10)}")
    print("  first req / the rest: out tok/s of the first request (nothing learned yet) and of the others")
    if "answers_as_taught" in a:
        print(f"  off's answers equal to the one the worked exchange teaches: {a['answers_as_taught']}/"
              f"{s['num_prompts']}")


def print_json(j: dict) -> None:
    s = j["settings"]
    levels = s["concurrency"]
    print(f"\njson: the agent's tool call under its JSON schema (fixed keys, two enums, a date pattern, no "
          f"whitespace), {s['num_prompts']} requests, max_tokens {s['max_tokens']}; forced drafts: "
          f"{s['forced_drafts']}")
    print(f"{'configuration':36}" + "".join(f"{('one at a time' if c == 1 else f'{c} at once'):>28}" for c in levels))
    for x in j["configs"].values():
        if "error" in x:
            print(f"{x['label']:36} failed: {x['error']}")
            continue
        line = f"{x['label']:36}"
        for c in levels:
            y = x["concurrency"][str(c)]
            line += (f"{y['output_tokens_per_s']:>10.1f} tok/s {_f(y.get('speedup_vs_off'), '.2f', 5)}x "
                     f"len {_f(y['mean_acceptance_length'], '.2f', 4)}")
        print(line)
    for key, where in (("forced_vs_without", "one at a time"), ("forced_vs_without_at_once", "all at once")):
        value, of = j[key]
        if value is not None:
            print(f"  with forced drafts over without, {where}: {value:.2f}x ({of})")
    if "valid_calls" in j:
        print(f"  off's outputs that call the tool with the request's city, date and unit: "
              f"{j['valid_calls']}/{s['num_prompts']}")


def print_trace(t: dict) -> None:
    ts = t["settings"]
    print(f"\nrandom-token trace (the throughput workload's: {ts['num_requests']} requests, input {ts['input_len'][0]}-"
          f"{ts['input_len'][1]}, output {ts['output_len'][0]}-{ts['output_len'][1]} tokens, greedy, ignore_eos)")
    for name in ("off", f"ngram_k{ts['ngram_k']}", f"suffix_k{ts['suffix_k']}"):
        x = t[name]
        if "error" in x:
            print(f"  {name:12} failed: {x['error']}")
            continue
        spec, extra = x.get("spec_decode"), ""
        if spec and "speedup_vs_off" in x:
            drafted = (f"acceptance length {spec['mean_acceptance_length']:.2f}, rate "
                       f"{spec['draft_acceptance_rate']:.1%} over {spec['num_drafts']} drafting steps"
                       if spec["num_drafts"] else "no drafts proposed")
            extra = f", {x['speedup_vs_off']:.2f}x off's, {drafted}, = off {x['identical_to_off']}/{ts['num_requests']}"
            extra += (f"; costs {x['cost']:.1%}" if x["cost"] >= 0 else
                      f"; gains {-x['cost']:.1%} (drafts found in the model's own output)")
        print(f"  {name:12} {x['output_tokens_per_s']:8.1f} out tok/s{extra}")


def print_vllm(v: dict) -> None:
    print("\nvLLM (its own environment, the same prompts and token ids, its own n-gram and suffix speculation; one engine "
          "for every concurrency, so its suffix cache holds the answers of the concurrencies before: optimistic past 1)")
    if "skipped" in v:
        print(f"  not run: {v['skipped']}")
        return
    for name, x in v.items():
        if "skipped" in x:
            print(f"  {name:12} not run: {x['skipped']}")
            continue
        parts = []
        runs = {**{(f"{c} at once" if c != "1" else "one at a time"): y for c, y in x["concurrency"].items()},
                **({"agent": x["agent"]} if "agent" in x else {})}
        for label, y in runs.items():
            rel = f" ({y['speedup_vs_off']:.2f}x, = off {y['identical_to_off']}" if "speedup_vs_off" in y else ""
            if rel and y.get("spec_decode"):
                rel += f", acc len {y['spec_decode']['mean_acceptance_length']:.2f}"
            parts.append(f"{label} {y['output_tokens_per_s']:.1f}{rel + ')' if rel else ''}")
        print(f"  {name:12} vllm {x['version']} out tok/s: " + "; ".join(parts))
