"""The slowest tenth of each agentic run: how much of what each request prefilled was new
(its message, the previous answer, the chat markers, the previous prompt's partial last
block) and how much an infinite cache would have held (the rest)."""
import json, sys, statistics as st
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[3])
VOCAB = ["kernel","router","cache","block","prefix","tensor","replica","envoy","token","latency","decode","prefill"]
def document(seed, words):
    return f"Document {seed}:" + "".join(" " + VOCAB[(i*7 + seed*13 + i//5) % 12] for i in range(words))
def pct(v, p):
    v = sorted(v); k = (len(v)-1)*p/100; f = int(k); c = min(f+1, len(v)-1)
    return v[f] + (v[c]-v[f])*(k-f)
trace = [json.loads(l) for l in open(sys.argv[2])][1:]
by_session = {t["session"]: t for t in trace}
def step_of(req):
    parts = req.split(".")
    step = by_session[parts[0]]["steps"][int(parts[1][1:])]
    if len(parts) > 2:
        step = step["subagents"][int(parts[2][1:])][int(parts[3][1:])]
    return step
def prev_id(req):
    parts = req.split(".")
    k = int(parts[-1][1:])
    if k > 0: return ".".join(parts[:-1] + [f"s{k-1}"])
    if len(parts) > 2: return ".".join(parts[:2])
    return None
cache = {}
def msg_tokens(step):
    key = (step["seed"], step["tokens"], step["kind"])
    if key not in cache:
        text = document(step["seed"], step["tokens"])
        if step["kind"] == "tool": text = f"<tool_response>\n{text}\n</tool_response>"
        cache[key] = len(tok.encode(text, add_special_tokens=False).ids)
    return cache[key]
print("policy | gateways | p90 | slowest tenth | new tokens (median) | held by an infinite cache but prefilled (median, p75) | of their prefill")
for line in open(sys.argv[1]):
    r = json.loads(line); run = r["run"]
    oc = [o for o in r.get("outcomes", []) if o["status"] == 200 and o["ttft"] is not None]
    by_id = {o["request"]: o for o in oc}
    t90 = pct([o["ttft"] for o in oc], 90)
    slow = [o for o in oc if o["ttft"] >= t90]
    fresh, extra, prefill = [], [], 0
    for o in slow:
        step = step_of(o["request"]); p = by_id.get(prev_id(o["request"]) or "")
        new = msg_tokens(step) + 10
        if p: new += p["output_tokens"] + p["prompt_tokens"] % 16
        unc = o["prompt_tokens"] - o["cached_tokens"]
        fresh.append(new); extra.append(max(0, unc - new)); prefill += unc
    print(f'{run["policy"]} | {run["gateways"]} | {t90*1000:.0f} ms | {len(slow)} | {st.median(fresh):.0f} | {st.median(extra):.0f}, {pct(extra,75):.0f} | {sum(extra)/prefill*100:.1f} %')
