"""HuggingFace transformers' ``generate`` on a small Llama with random weights: a real decode loop to trace.

Nothing is downloaded: the model is built from a ``LlamaConfig`` with a few
layers and random weights, so the example runs on a machine without network
access. Run it under ``syncless trace`` with ``generate`` checked, and the
table it prints lists every hidden GPU<->CPU sync in transformers' own code,
with how often each ran::

    syncless trace --fn transformers.generation.utils:GenerationMixin.generate \\
        examples/transformers_generate.py --new-tokens 32

On its own (``python examples/transformers_generate.py``) it only generates.
It needs ``pip install 'syncless[examples]'`` (transformers) and a CUDA GPU
for anything to be checked; on the CPU it runs, and the trace says that
nothing could be checked.
"""

from __future__ import annotations

import argparse
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence (default: 32)")
    parser.add_argument("--batch", type=int, default=4, help="sequences generated together (default: 4)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length (default: 16)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the random model (default: 4)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    args = parser.parse_args()
    for name in ("new_tokens", "batch", "prompt_tokens", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, config.vocab_size, (args.batch, args.prompt_tokens), generator=generator).to(device)
    mask = torch.ones_like(prompt)
    start_s = time.perf_counter()
    with torch.inference_mode():
        # min_new_tokens = max_new_tokens: every call decodes the same number of steps (no early EOS).
        out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=config.pad_token_id)
    elapsed_s = time.perf_counter() - start_s
    generated = out.shape[1] - prompt.shape[1]
    print(f"transformers generate: {args.batch} sequences x {generated} new tokens on {device} in {elapsed_s:.2f} s "
          f"({args.layers} layers, random weights)")


if __name__ == "__main__":
    main()
