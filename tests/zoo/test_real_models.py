"""Real model families, unchanged (Hugging Face GPT-2, BERT, Llama, OPT, BART, T5, MPNet, + peft LoRA): one private step
with zero noise equals −Σ clip_C(g_i)/B from a per-example loop (float64), on the engine `auto` picks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).parent))

import zoo  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, T, N = 64, 8, 6


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, V, (N, T), generator=g), torch.randint(0, 2, (N,), generator=g))


def gpt2():
    c = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(c)


def bert():
    c = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(c)


def llama():
    c = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(c)


def bert_choice():
    c = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return transformers.BertForMultipleChoice(c)


def opt():
    c = transformers.OPTConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                               max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0)
    return transformers.OPTForCausalLM(c)


def bart():
    c = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, scale_embedding=True)
    return transformers.BartForConditionalGeneration(c)


def t5():
    c = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(c)


def mpnet():
    c = transformers.MPNetConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=24, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, pad_token_id=0)
    return transformers.MPNetForSequenceClassification(c)


def _eager_experts(model):
    """The experts' plain loop (torch.nonzero routing) instead of the default grouped_mm kernel, which has no float64
    CPU implementation (these tests run in float64)."""
    model.config._experts_implementation = "eager"
    return model


def deberta_v3():
    """DeBERTa-v3's relative attention: an embedding weight read outside its forward, layer-normed, projected by the
    attention's own query/key layers (also called on the batch), repeated per example (``repeat(B, 1, 1)`` of
    ``[H, 2k, d]``) and multiplied with the flattened queries in a ``bmm``."""
    c = transformers.DebertaV2Config(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pooler_dropout=0.0, relative_attention=True,
                                     position_buckets=8, max_relative_positions=-1, share_att_key=True,
                                     pos_att_type="p2c|c2p", norm_rel_ebd="layer_norm", position_biased_input=False)
    return transformers.DebertaV2ForSequenceClassification(c)


def mixtral():
    c = transformers.MixtralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=16)
    return _eager_experts(transformers.MixtralForCausalLM(c))


def qwen2_moe():
    c = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=16)
    return _eager_experts(transformers.Qwen2MoeForCausalLM(c))


def lora(make, targets, **options):
    return lambda: peft.get_peft_model(make(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                               lora_dropout=0.0, **options))


class Wrapped(zoo.Base):
    """The model wrapped unchanged; the LM loss is each example's own token mean (per_example_token_mean)."""

    def __init__(self, make, kind: str) -> None:
        super().__init__()
        self.m, self.kind = make(), kind

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.kind == "lm":
            return zoo.per_example_token_mean(self.m(input_ids=x).logits[:, :-1], x[:, 1:])
        if self.kind == "seq2seq":
            return zoo.per_example_token_mean(self.m(input_ids=x, decoder_input_ids=x[:, :4]).logits, x[:, 1:5])
        if self.kind == "choice":  # [B, 2, T] choices, flattened to [B·2, T] by the model
            return F.cross_entropy(self.m(input_ids=torch.stack([x, x.flip(1)], 1)).logits, y)
        return F.cross_entropy(self.m(input_ids=x).logits, y)


CASES = {
    "gpt2": (gpt2, "lm"),
    "bert": (bert, "cls"),
    "llama": (llama, "lm"),
    "gpt2-lora": (lora(gpt2, ["c_attn", "c_proj"]), "lm"),
    "llama-lora": (lora(llama, ["q_proj", "v_proj"]), "lm"),
    # LoRA on the token embedding: F.embedding(ids, lora_embedding_A.T) @ lora_embedding_B.T (a functional lookup site)
    "gpt2-lora-embed": (lora(gpt2, ["wte", "c_attn"]), "lm"),
    # DoRA: the LoRA layers also called on an identity matrix (a lookup whose output is used detached) besides
    # the batch; the magnitude layer replays the frozen base layer inside vmap
    "gpt2-dora": (lora(gpt2, ["c_attn"], use_dora=True), "lm"),
    # IA3: scaling vectors in a ParameterDict (no forward) that each wrapped layer reads and multiplies in
    "llama-ia3": (lambda: peft.get_peft_model(llama(), peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                                      feedforward_modules=["down_proj"])), "lm"),
    # OPT flattens [B, T, d] to [B·T, d] before fc1 (a verified view; fc2 matched by row count)
    "opt": (opt, "lm"),
    # BertForMultipleChoice: [B, 2, T] flattened to [B·2, T] before the encoder; [1, T] positions broadcast over it
    "bert-choice": (bert_choice, "choice"),
    # BART: shared/embed_tokens/lm_head tied, `shared` itself never called; scaled embedding subclass
    "bart": (bart, "seq2seq"),
    # T5/MPNet: relative position bias looked up with [T, T] indices, broadcast over the batch (broadcast sites)
    "t5": (t5, "seq2seq"),
    "mpnet": (mpnet, "cls"),
    "deberta-v3": (deberta_v3, "cls"),
    # mixture of experts: a router returning logits and the top-k weights taken from them (multi-output aliasing),
    # experts owning stacked weights with an act_fn child, routing by torch.nonzero (one replay per example)
    "mixtral": (mixtral, "lm"),
    "qwen2-moe": (qwen2_moe, "lm"),
}


TOLERANCE = {name: {"rtol": 1e-5, "atol": 1e-8} for name in ("mixtral", "qwen2-moe")}
"""Their routers take the softmax of the logits in float32 (``router_logits.float()``), whatever the model's dtype:
the batched and the one-example forwards then round differently (~1e-7 relative)."""


@pytest.mark.parametrize("name", list(CASES))
def test_real_model_step_is_exact_on_the_fast_engine(name):
    make, kind = CASES[name]
    torch.manual_seed(0)
    frozen_before = {}

    def factory():
        model = Wrapped(make, kind)
        frozen_before.update({n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad})
        return model

    strategy = zoo.assert_exact(factory, _data(), **TOLERANCE.get(name, {}))
    assert strategy.engine_name == "ghost"
    model = strategy.lightning_module
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach(), frozen_before[n].to(p.dtype)), n


def test_hugging_face_default_loss_with_padding_is_refused():
    """HF's own LM loss is a token mean over the whole batch: with padding, examples interact."""

    class HFLoss(zoo.Base):
        def __init__(self):
            super().__init__()
            self.m = gpt2()

        def training_step(self, batch, batch_idx):
            x, y = batch
            labels = x.clone()
            for i in range(x.shape[0]):
                labels[i, 2 + int(y[i]) * 3 + i % 2:] = -100  # examples of different lengths
            return self.m(input_ids=x, labels=labels).loss

    zoo.assert_refused(HFLoss, _data(), "per_example_token_mean")




def deberta():
    c = transformers.DebertaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, pooler_dropout=0.0)
    return transformers.DebertaForSequenceClassification(c)


def test_parameters_owned_by_attention_containers_are_exact():
    """DeBERTa's attention owns q_bias/v_bias next to its child layers (root_parameters.py, broadcast sites)."""
    torch.manual_seed(0)
    assert zoo.assert_exact(lambda: Wrapped(deberta, "cls"), _data()).engine_name == "ghost"


class Vision(zoo.Base):
    def __init__(self, make) -> None:
        super().__init__()
        self.m = make()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.m(pixel_values=x).logits, y)


def swin():
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def convnext():
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_stages=2, patch_size=4, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2, image_size=16))


def beit():
    return transformers.BeitForImageClassification(transformers.BeitConfig(
        image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=2, use_relative_position_bias=True, layer_scale_init_value=0.1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def pvt():
    return transformers.PvtForImageClassification(transformers.PvtConfig(
        image_size=16, num_encoder_blocks=2, depths=[1, 1], sequence_reduction_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def swinv2():
    return transformers.Swinv2ForImageClassification(transformers.Swinv2Config(
        image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


@pytest.mark.parametrize("make", [swin, convnext, beit, pvt, swinv2], ids=["swin", "convnext", "beit", "pvt", "swinv2"])
def test_vision_families_are_exact(make):
    """Swin: windows flattened to [B·windows, …] (verified view) and a bias table owned by its attention;
    ConvNeXt: layer scale owned by a block; BEiT: relative bias table and layer scale; PVT: its position table read
    twice and concatenated (and a cls token in the last stage); Swin V2: an MLP over a coordinate table (two lookups
    in a row, an in-place ReLU between)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, 16, 16, generator=g), torch.randint(0, 2, (N,), generator=g))
    assert zoo.assert_exact(lambda: Vision(make), data).engine_name == "ghost"


class MaskedAutoencoder(zoo.Base):
    """ViTMAE's own loss (every example masks as many patches: a mean over examples); a fixed masking noise."""

    def __init__(self) -> None:
        super().__init__()
        self.m = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
            image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, decoder_hidden_size=16, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
            decoder_intermediate_size=32, mask_ratio=0.5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        noise = torch.arange(16, dtype=x.dtype).flip(0).expand(x.shape[0], 16)
        return self.m(pixel_values=x, noise=noise).loss


def test_masked_autoencoder_tokens_repeated_over_the_batch_are_exact():
    """ViTMAE's decoder copies its mask_token with .repeat(B, k, 1) (root_parameters.py, broadcast sites)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, 16, 16, generator=g), torch.zeros(N, dtype=torch.long))
    assert zoo.assert_exact(MaskedAutoencoder, data).engine_name == "ghost"


def test_mixture_of_experts_grouped_kernel_step_equals_the_plain_loop():
    """The default experts kernel (grouped_mm, float32 only on CPU) gives the same private step as the plain loop
    that the float64 test checks exactly."""
    data = _data()
    updates = []
    for implementation in ("grouped_mm", "eager"):
        torch.manual_seed(0)
        model = Wrapped(mixtral, "lm")
        model.m.config._experts_implementation = implementation
        _, update = zoo.private_step(model, data)
        updates.append(update)
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
