"""HuggingFace transformers as the test oracle (torch CPU; a test-only dependency)."""

import numpy as np


def hf_bert(path):
    from transformers import BertModel
    return BertModel.from_pretrained(str(path), attn_implementation="eager").eval()


def hf_gpt2(path):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()


def hf_hidden_states(model, ids: np.ndarray, token_types: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Last hidden states (B, S, H) float32 for a padded batch."""
    import torch
    mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64)),
                    token_type_ids=torch.from_numpy(token_types.astype(np.int64)),
                    attention_mask=torch.from_numpy(mask))
    return out.last_hidden_state.numpy()


def st_pooling(hidden, lengths, modes):
    """sentence-transformers' Pooling module, restated in torch over (B, S, H) hidden states."""
    import torch
    x = torch.from_numpy(hidden)
    mask = (torch.arange(x.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]).unsqueeze(-1).float()
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(x[:, 0])
        elif mode == "max":
            parts.append(torch.where(mask > 0, x, torch.tensor(-1e9)).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len"):
            total = (x * mask).sum(1)
            count = mask.sum(1).clamp(min=1e-9)
            parts.append(total / count if mode == "mean" else total / count.sqrt())
        elif mode == "weightedmean":  # position weights 1..n over the real tokens
            weights = mask * torch.arange(1, x.shape[1] + 1, dtype=torch.float32)[None, :, None]
            parts.append((x * weights).sum(1) / weights.sum(1).clamp(min=1e-9))
        elif mode == "lasttoken":
            parts.append(x[torch.arange(x.shape[0]), torch.from_numpy(lengths).long() - 1])
    return torch.cat(parts, dim=1).numpy()


def hf_seq2seq_generate(model, tokenizer, text: str, **options) -> tuple:
    """HF generate's hypotheses for one source (the ids after the decoder's start token, up to
    and including the first eos, which pads follow: T5's pad id is also a token it generates) and
    its beam scores (None without beams)."""
    import torch
    inputs = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, **options, output_scores=True, return_dict_in_generate=True)
    eos = model.generation_config.eos_token_id
    ends = set(eos) if isinstance(eos, list) else {eos}
    hypotheses = []
    for row in out.sequences:
        ids = row[1:].tolist()
        cut = next((k for k, t in enumerate(ids) if t in ends), len(ids) - 1)
        hypotheses.append(ids[:cut + 1])
    scores = getattr(out, "sequences_scores", None)
    return hypotheses, None if scores is None else scores.tolist()


def assert_candidates_match(results, expected, score_tolerance: float):
    """Each translation result's candidates are its expected (hypotheses, beam scores), token for
    token, the scores within score_tolerance."""
    for result, (hypotheses, scores) in zip(results, expected):
        assert [c.token_ids for c in result.candidates] == hypotheses, result.source
        if scores is not None:
            assert np.abs(np.array([c.score for c in result.candidates]) - scores).max() <= score_tolerance


def assert_encoder_and_first_logits_match(folder, model, tokenizer, texts, tolerance: float):
    """The NumPy seq2seq runner on `folder` against the HF model: each source's encoder output and the
    logits of the decoder's first step (from its start token), within `tolerance`."""
    import torch
    from ftengine.backends import numpy_ops
    from ftengine.config import load_seq2seq_config
    from ftengine.models.seq2seq import Seq2SeqRunner
    from ftengine.seq2seq_checkpoint import load_seq2seq_weights
    config = load_seq2seq_config(folder)
    runner = Seq2SeqRunner(config, load_seq2seq_weights(folder, config), numpy_ops, dtype="fp32", max_batch=4,
                           max_len=16, max_source=32)
    sources = [tokenizer(t).input_ids for t in texts]
    runner.encode(sources)
    total = sum(map(len, sources))
    states = np.array(numpy_ops.to_host(runner.ws.view(runner.out, (total, config.d_model))))  # a copy: prefill reuses it
    start = config.decoder_start_token_id
    runner.prefill([[start]] * len(sources))
    logits = runner.logits(len(sources))
    at = 0
    for i, ids in enumerate(sources):
        with torch.no_grad():
            ref_states = model.get_encoder()(torch.tensor([ids])).last_hidden_state[0].numpy()
            ref_logits = model(input_ids=torch.tensor([ids]),
                               decoder_input_ids=torch.tensor([[start]])).logits[0, -1].numpy()
        assert np.abs(states[at:at + len(ids)] - ref_states).max() <= tolerance
        assert np.abs(logits[i] - ref_logits).max() <= tolerance
        at += len(ids)
