"""Training forward passes of the speech-token LMs over the inference modules (upstream llm.py `forward`).

Every tensor operation is the one upstream's training graph runs, in the same order, so that the
loss, its gradients and Adam's updates are bit-identical on the CPU:
- Qwen2LM / CosyVoice3LM: sequences built per utterance (bistream with probability 1/2 when the
  speech is more than mix_ratio[1]/mix_ratio[0] times longer than the text, one `random.random()`
  per utterance), padded with -1, run through the Qwen decoder under transformers 4.51's masks.
- Loss: label smoothing KL (upstream's LabelSmoothingLoss), normalized by the target count;
  accuracy: argmax over the non-ignored targets.
With `checkpointing`, each Qwen layer recomputes its activations during backward (same numbers);
the other models' blocks are checkpointed by memory.py.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence, unpad_sequence
from torch.utils.checkpoint import checkpoint

from mizuoto.nn.lm.decoder import Decoder, attend
from mizuoto.nn.transformer.masks import make_pad_mask

IGNORE_ID = -1


def _on(batch: dict, device: torch.device, *keys: str) -> list[torch.Tensor]:
    return [batch[k].to(device) for k in keys]


def causal_mask_451(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """transformers 4.51's SDPA mask for a 2-D padding mask: None when nothing is padded, else (B, 1, T, T) additive."""
    if bool(torch.all(valid == 1)):
        return None  # then SDPA runs with is_causal=True
    b, t = valid.shape
    low = torch.finfo(dtype).min
    mask = torch.full((t, t), fill_value=low, dtype=dtype, device=valid.device)
    mask *= torch.arange(t, device=valid.device) > torch.arange(t, device=valid.device).reshape(-1, 1)
    mask = mask[None, None, :, :].expand(b, 1, -1, -1).clone()
    padded = (mask + valid[:, None, None, :]) == 0
    mask[:, :, :, :t] = mask.masked_fill(padded, low)
    return mask


def _qwen_layer(dec: Decoder, i: int, x, cos, sin, mask):
    q, k, v = dec.layer_pre(i, x, cos, sin)
    return dec.layer_post(i, x, attend(q, k, v, dec.n_rep, dec.scale, mask))


def qwen_hidden(dec: Decoder, xs: torch.Tensor, lengths: torch.Tensor, checkpointing: bool = False) -> torch.Tensor:
    """Qwen2Model's last hidden states (normed) of padded inputs, as upstream's Qwen2Encoder.forward."""
    t = xs.size(1)
    valid = ~make_pad_mask(lengths, t)
    positions = torch.arange(0, t, device=xs.device).unsqueeze(0)
    cos, sin = dec.rope(positions, xs.dtype)
    mask = causal_mask_451(valid, xs.dtype)
    x = xs
    for i in range(len(dec.layers)):
        if checkpointing and torch.is_grad_enabled():
            x = checkpoint(_qwen_layer, dec, i, x, cos, sin, mask, use_reentrant=False)
        else:
            x = _qwen_layer(dec, i, x, cos, sin, mask)
    return dec.norm(x)


def label_smoothing_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float,
                         normalize_length: bool) -> torch.Tensor:
    """KL divergence to the smoothed one-hot target, ignored targets masked out (upstream's LabelSmoothingLoss)."""
    size = logits.size(2)
    batch_size = logits.size(0)
    x = logits.view(-1, size)
    target = target.view(-1)
    true_dist = torch.zeros_like(x)
    true_dist.fill_(smoothing / (size - 1))
    ignore = target == IGNORE_ID
    total = len(target) - ignore.sum().item()
    target = target.masked_fill(ignore, 0)
    true_dist.scatter_(1, target.unsqueeze(1), 1.0 - smoothing)
    kl = F.kl_div(torch.log_softmax(x, dim=1), true_dist, reduction="none")
    denom = total if normalize_length else batch_size
    return kl.masked_fill(ignore.unsqueeze(1), 0).sum() / denom


def accuracy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Share of non-ignored targets the argmax hits."""
    pred = logits.view(target.size(0), target.size(1), logits.size(-1)).argmax(2)
    mask = target != IGNORE_ID
    hits = torch.sum(pred.masked_select(mask) == target.masked_select(mask))
    return (hits / torch.sum(mask)).detach()


def _sequences(lm, sos, task_id, text, text_emb, text_len, speech, speech_emb, speech_len,
               instruct_emb, instruct_len, rng) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_text, n_speech = lm.mix_ratio
    text = unpad_sequence(text, text_len.cpu(), batch_first=True)
    speech = unpad_sequence(speech, speech_len.cpu(), batch_first=True)
    text_emb = unpad_sequence(text_emb, text_len.cpu(), batch_first=True)
    speech_emb = unpad_sequence(speech_emb, speech_len.cpu(), batch_first=True)
    if instruct_emb is not None:
        instruct_emb = unpad_sequence(instruct_emb, instruct_len.cpu(), batch_first=True)
    else:
        instruct_emb = [torch.empty(0, text_emb[0].shape[-1]).to(text_emb[0])] * len(text)
        instruct_len = torch.zeros(len(text)).to(text_len)
    sos, task_id = sos.squeeze(dim=0), task_id.squeeze(dim=0)
    targets, inputs = [], []
    for i in range(len(text)):
        if rng.random() < 0.5 and speech_len[i] / text_len[i] > n_speech / n_text:
            target, parts = [IGNORE_ID] + [IGNORE_ID] * instruct_len[i], [sos, instruct_emb[i]]
            for j in range(((text_len[i] + 1) / n_text).ceil().int().item()):
                piece = text[i][j * n_text:(j + 1) * n_text].tolist()
                if len(piece) == n_text:
                    target += [IGNORE_ID] * (n_text - 1) + speech[i][j * n_speech:(j + 1) * n_speech].tolist()
                    target.append(lm.fill_token)
                    parts += [text_emb[i][j * n_text:(j + 1) * n_text],
                              speech_emb[i][j * n_speech:(j + 1) * n_speech]]
                else:
                    target += [IGNORE_ID] * len(piece) + speech[i][j * n_speech:].tolist() + [lm.eos_token]
                    parts += [text_emb[i][j * n_text:], task_id, speech_emb[i][j * n_speech:]]
            targets.append(torch.tensor(target))
            inputs.append(torch.concat(parts, dim=0))
        else:
            targets.append(torch.tensor([IGNORE_ID] * (1 + instruct_len[i] + text_len[i])
                                        + speech[i].tolist() + [lm.eos_token]))
            inputs.append(torch.concat([sos, instruct_emb[i], text_emb[i], task_id, speech_emb[i]], dim=0))
    lengths = torch.tensor([x.size(0) for x in inputs], dtype=torch.int32)
    return (pad_sequence(targets, batch_first=True, padding_value=IGNORE_ID),
            pad_sequence(inputs, batch_first=True, padding_value=IGNORE_ID), lengths)


def qwen_lm_loss(lm, batch: dict, device: torch.device, smoothing: float = 0.0, normalize_length: bool = True,
                 checkpointing: bool = False, rng=random) -> dict[str, torch.Tensor]:
    """{'loss', 'acc'} of a Qwen2LM / CosyVoice3LM batch (upstream Qwen2LM.forward)."""
    text, text_len, speech, speech_len = _on(batch, device, "text_token", "text_token_len", "speech_token",
                                             "speech_token_len")
    text_emb = lm.llm.embed_tokens(text)
    speech_emb = lm.speech_embedding(speech)
    instruct_emb = instruct_len = None
    if lm.variant == "CosyVoice3LM":
        sos = lm.speech_embedding.weight[lm.sos].reshape(1, 1, -1)
        task_id = lm.speech_embedding.weight[lm.task_id].reshape(1, 1, -1)
        instruct, instruct_len = _on(batch, device, "instruct_token", "instruct_token_len")
        instruct_emb = lm.llm.embed_tokens(instruct)
    else:
        sos = lm.llm_embedding.weight[0].reshape(1, 1, -1)
        task_id = lm.llm_embedding.weight[1].reshape(1, 1, -1)
    target, lm_input, lengths = _sequences(lm, sos, task_id, text, text_emb, text_len, speech, speech_emb,
                                           speech_len, instruct_emb, instruct_len, rng)
    target = target.to(device)
    hidden = qwen_hidden(lm.llm, lm_input, lengths.to(device), checkpointing)
    logits = lm.llm_decoder(hidden)
    loss = label_smoothing_loss(logits, target, smoothing, normalize_length)
    acc = accuracy(logits.view(-1, lm.llm_decoder.out_features), target)
    return {"loss": loss, "acc": acc}


def transformer_lm_loss(lm, batch: dict, device: torch.device, smoothing: float = 0.0,
                        normalize_length: bool = True) -> dict[str, torch.Tensor]:
    """{'loss', 'acc'} of a CosyVoice 1 TransformerLM batch (upstream TransformerLM.forward)."""
    text, text_len, speech, speech_len, embedding = _on(batch, device, "text_token", "text_token_len", "speech_token",
                                                        "speech_token_len", "embedding")
    targets = [torch.tensor([IGNORE_ID] * (2 + int(text_len[i])) + speech[i, :speech_len[i]].tolist()
                            + [lm.speech_token_size]) for i in range(text.size(0))]
    target = pad_sequence(targets, batch_first=True, padding_value=IGNORE_ID).to(device)
    encoded, mask = lm.text_encoder(lm.text_embedding(text), text_len, decoding_chunk_size=1,
                                    num_decoding_left_chunks=-1)
    encoded_len = mask.squeeze(1).sum(1)
    encoded = lm.text_encoder_affine_layer(encoded)
    embedding = lm.spk_embed_affine_layer(F.normalize(embedding, dim=1)).unsqueeze(1)
    sos = lm.llm_embedding.weight[0].reshape(1, 1, -1).squeeze(dim=0)
    task_id = lm.llm_embedding.weight[1].reshape(1, 1, -1).squeeze(dim=0)
    speech_emb = lm.speech_embedding(speech)
    encoded = unpad_sequence(encoded, encoded_len.cpu(), batch_first=True)
    speech_emb = unpad_sequence(speech_emb, speech_len.cpu(), batch_first=True)
    inputs = [torch.concat([sos, embedding[i], encoded[i], task_id, speech_emb[i]], dim=0)
              for i in range(len(encoded))]
    lengths = torch.tensor([x.size(0) for x in inputs], dtype=torch.int32)
    lm_input = pad_sequence(inputs, batch_first=True, padding_value=IGNORE_ID)
    hidden, _ = lm.llm(lm_input, lengths.to(device))
    logits = lm.llm_decoder(hidden)
    loss = label_smoothing_loss(logits, target, smoothing, normalize_length)
    acc = accuracy(logits.view(-1, lm.speech_token_size + 1), target)
    return {"loss": loss, "acc": acc}

