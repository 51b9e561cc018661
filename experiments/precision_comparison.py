"""bf16 against float32 on one model: per-token KL of the output distributions and the
effective depths read from each. `--narrow bfloat16` (the default) runs weights and activations in
bf16; `--narrow bf16-matmuls` keeps activations in float32 and only the layers' weight matrices in
bf16 (`ModelWeights.with_matmul_dtype`).

    python experiments/precision_comparison.py --model smollm2 --data ../shared/data/gsm8k_test_sample.jsonl
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses import contributions, effective_depth as ed, logit_lens
from jaxdepth.lab.sources import load
from jaxdepth.core.model import forward
from jaxdepth.lab.prompts import encode, load_prompts

HERE = os.path.dirname(os.path.abspath(__file__))


@jax.jit
def _kl(logits_ref, logits):
    logp_ref, logp = jax.nn.log_softmax(logits_ref, -1), jax.nn.log_softmax(logits, -1)
    return jnp.sum(jnp.exp(logp_ref) * (logp_ref - logp), -1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", default=os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl"))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--narrow", choices=["bfloat16", "bf16-matmuls"], default="bfloat16")
    args = parser.parse_args()

    f32 = load(args.model)
    bf16 = f32.astype(jnp.bfloat16) if args.narrow == "bfloat16" else f32.with_matmul_dtype(jnp.bfloat16)
    batch = encode(f32.tokenizer, load_prompts("gsm8k", args.data, limit=args.prompts))
    kls, agree = [], []
    for i in range(len(batch)):
        one = batch.single(i)
        tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
        a = forward(f32.params, tokens, f32.config, valid=valid)
        b = forward(bf16.params, tokens, f32.config, valid=valid)
        kls.append(np.asarray(_kl(a, b))[one.valid])
        agree.append(np.asarray(a.argmax(-1) == b.argmax(-1))[one.valid])
    kl, agree = np.concatenate(kls), np.concatenate(agree)
    print(f"{args.model}, {len(batch)} GSM8K prompts, {kl.size} tokens")
    print(
        f"{args.narrow}: per-token KL(P_f32 || P_bf16) in nats: mean {kl.mean():.2e}, median {np.median(kl):.2e}, "
        f"p99 {np.quantile(kl, 0.99):.2e}, max {kl.max():.2e}; top-1 agreement {agree.mean():.4f}"
    )
    for name, model in (("float32", f32), (args.narrow, bf16)):
        c = contributions.contributions(model.params, batch, model.config)
        lens = logit_lens.logit_lens(model.params, batch, model.config)
        print(
            f"{name:12s} cosine ED {ed.cosine_effective_depth(c.mean_cosine)}; KL ED "
            f"{ed.kl_effective_depth(lens.kl)}; overlap ED {ed.overlap_effective_depth(lens.overlap)}"
        )


if __name__ == "__main__":
    main()
