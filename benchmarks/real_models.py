"""Per-step time of real model families under DPStrategy's engines vs non-private. Run by hand:

    python benchmarks/real_models.py                       # every model, 1 and 2 threads
    python benchmarks/real_models.py --models gpt2,lstm --threads 1 --steps 20
    python benchmarks/real_models.py --device cuda --batch 64 --seq 128 --hidden 256 --threads 1

Tiny randomly initialised models built from configs (hidden 64, 2 layers, batch 16, T = 32),
as a user would wrap them: Hugging Face GPT-2 / BERT / Llama / OPT / T5 / ViT (32×32 images, 4×4 patches;
+ peft LoRA r = 4) when
``transformers``/``peft`` are installed, and torch's ``nn.TransformerEncoder``
(``nn.MultiheadAttention``), ``nn.LSTM``, ``nn.GRU`` (and, when named, ``opacus-dplstm``: the LSTM
swapped for ``opacus.layers.DPLSTM``). A private step is the plain loop of
``benchmarks/speed.py``: forward, mean loss, backward, ``engine.clip_and_sum``, the library's
``Privatizer`` (σCz once, ÷B), SGD step; the engine is the one ``per_sample="auto"`` picks.
Modes are interleaved step by step so machine drift hits both alike; medians are printed, and
the ratio private/non-private. On a shared machine, ``--rounds R`` repeats each measurement R
times (fresh models) and prints the median of each column with the range of the ratio.
``--device cuda`` times each step between ``torch.cuda.synchronize()`` calls; ``--batch``/``--seq``/
``--hidden``/``--vocab`` resize every model and the batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.losses import per_example_token_mean
from lightning_dp.grad_sample import make_engine
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.privatizer import Privatizer
from lightning_dp.privacy.release import DEFAULT_REQUEST
from lightning_dp.grad_sample import select_engine

V, T, B, D = 512, 32, 16, 64


class TorchEncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, dim_feedforward=4 * D, dropout=0.1, batch_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.enc(self.emb(x), mask=mask, is_causal=True))


class RecurrentLM(nn.Module):
    """``packed``: the embeddings packed (``pack_padded_sequence``, unsorted) at lengths T/2 … T taken from each
    example's first token, the output padded back; the loss then covers the padding too (zeros in, as a user's
    padded batch would have)."""

    def __init__(self, kind: str, packed: bool = False) -> None:
        super().__init__()
        self.packed = packed
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        if kind == "DPLSTM":  # the swap Opacus asks for
            from opacus.layers import DPLSTM

            self.rnn: nn.Module = DPLSTM(D, D, num_layers=2, batch_first=True)
        else:
            self.rnn = getattr(nn, kind)(D, D, num_layers=2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        if not self.packed:
            return self.head(self.rnn(self.emb(x))[0])
        lengths = (x.shape[1] // 2 + x[:, 0] % (x.shape[1] // 2 + 1)).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
        out = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]
        return self.head(out)


def hf_models() -> dict[str, Callable[[], nn.Module]]:
    try:
        import peft
        import transformers as tf
    except ImportError:
        return {}

    def gpt2():
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=2, n_head=4))

    def bert():
        return tf.BertForSequenceClassification(tf.BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=4 * D,
                                                               max_position_embeddings=T))

    def llama():
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=4 * D,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=4, max_position_embeddings=T))

    def opt():
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=D, ffn_dim=4 * D, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=T, word_embed_proj_dim=D))

    def t5():
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=D, d_kv=D // 4, d_ff=4 * D,
                                                         num_layers=2, num_heads=4))

    def vit():  # 32×32 images in 4×4 patches: T = 64 tokens (+ cls_token and position table owned by a container)
        return tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=4, hidden_size=D, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=4 * D, num_labels=10))

    def lora(make, targets):
        return lambda: peft.get_peft_model(make(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))

    return {"gpt2": gpt2, "bert": bert, "llama": llama, "opt": opt, "t5": t5, "vit": vit,
            "gpt2-lora": lora(gpt2, ["c_attn", "c_proj"]), "llama-lora": lora(llama, ["q_proj", "v_proj"])}


def models() -> dict[str, Callable[[], nn.Module]]:
    return {**hf_models(), "torch-encoder": TorchEncoderLM, "lstm": lambda: RecurrentLM("LSTM"),
            "gru": lambda: RecurrentLM("GRU"), "lstm-packed": lambda: RecurrentLM("LSTM", packed=True)}


OPT_IN: dict[str, Callable[[], nn.Module]] = {"opacus-dplstm": lambda: RecurrentLM("DPLSTM")}
"""Run only when named (``--models lstm,opacus-dplstm``): ``nn.LSTM`` swapped for ``opacus.layers.DPLSTM``."""


PIXELS = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def configure(batch: int = B, seq: int = T, hidden: int = D, vocab: int = V) -> None:
    """Resize every model and batch (module-wide: the builders read these when called)."""
    global V, T, B, D, PIXELS
    V, T, B, D = vocab, seq, batch, hidden
    PIXELS = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _pixels(device: torch.device) -> Tensor:
    global PIXELS
    if PIXELS.device != device:
        PIXELS = PIXELS.to(device)
    return PIXELS


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    if getattr(getattr(model, "config", None), "model_type", "") == "vit":
        return F.cross_entropy(model(pixel_values=_pixels(x.device)).logits, y[:, 0] % 10)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        out = model(input_ids=x, decoder_input_ids=x)
    else:
        out = model(input_ids=x) if hasattr(model, "config") else model(x)
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dim() == 2:  # sequence classification
        return F.cross_entropy(logits, y[:, 0] % logits.shape[1])
    return per_example_token_mean(logits, y).mean()


def steps(make: Callable[[], nn.Module], engine_name: str,
          device: str = "cpu") -> tuple[Callable[[], None], Callable[[], None]]:
    """(non-private step, private step) closures on one fixed batch, each on its own copy of the model."""
    torch.manual_seed(0)
    plain, private_model = make(), make()
    private_model.load_state_dict(plain.state_dict())
    plain, private_model = plain.to(device), private_model.to(device)
    x, y = torch.randint(0, V, (B, T)).to(device), torch.randint(0, V, (B, T)).to(device)
    engine = make_engine(engine_name)
    engine.attach(private_model)
    privatizer = Privatizer(GaussianNoise())
    params = [p for p in private_model.parameters() if p.requires_grad]
    opt_plain = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=1e-3)
    opt_private = torch.optim.SGD(params, lr=1e-3)

    def nonprivate() -> None:
        opt_plain.zero_grad(set_to_none=True)
        loss_of(plain, x, y).backward()
        opt_plain.step()

    def private() -> None:
        opt_private.zero_grad(set_to_none=True)
        engine.begin_step(B)
        loss_of(private_model, x, y).backward()
        batch = engine.clip_and_sum(params, 1.0)
        privatizer.privatize(batch, params, DEFAULT_REQUEST, 1.0, 1.0, float(B))
        opt_private.step()

    return nonprivate, private


def measure(name: str, make: Callable[[], nn.Module], n_steps: int, device: str = "cpu",
            warmup: int = 2) -> tuple[str, float, float]:
    engine_name = select_engine(make())
    nonprivate, private = steps(make, engine_name, device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"nonprivate": [], "private": []}
    for i in range(n_steps + warmup):
        for mode, fn in (("nonprivate", nonprivate), ("private", private)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[mode].append(time.perf_counter() - t0)
    return engine_name, statistics.median(times["nonprivate"]) * 1e3, statistics.median(times["private"]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma-separated subset (default: all but opacus-dplstm)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=1, help="repeat each measurement; medians and the ratio's range")
    parser.add_argument("--device", default="cpu", help="torch device of the models and batch (cpu, cuda)")
    parser.add_argument("--batch", type=int, default=B)
    parser.add_argument("--seq", type=int, default=T)
    parser.add_argument("--hidden", type=int, default=D)
    parser.add_argument("--vocab", type=int, default=V)
    args = parser.parse_args()
    configure(args.batch, args.seq, args.hidden, args.vocab)
    table = models()
    names = [m for m in args.models.split(",") if m] or list(table)
    table.update(OPT_IN)
    rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
    on = "" if args.device == "cpu" else f"{args.device}: "
    print(f"{on}batch {B}, T {T}, hidden {D}, vocab {V}; median ms/step over {args.steps} steps (interleaved){rounds}")
    print(f"{'model':14s} {'threads':>7s} {'engine':>7s} {'non-private':>12s} {'private':>9s} {'ratio':>6s}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name in names:
            runs = [measure(name, table[name], args.steps, args.device) for _ in range(args.rounds)]
            engine = runs[0][0]
            base, priv = (statistics.median(r[k] for r in runs) for k in (1, 2))
            ratios = [r[2] / r[1] for r in runs]
            spread = f"  ({min(ratios):.2f}–{max(ratios):.2f})" if len(runs) > 1 else ""
            ratio = statistics.median(ratios)
            print(f"{name:14s} {threads:7d} {engine:>7s} {base:12.1f} {priv:9.1f} {ratio:6.2f}{spread}", flush=True)


if __name__ == "__main__":
    main()
