"""numqsa.integrations.transformers against HF transformers' own Qwen4Exp QSA path.

Simulator tier (torch CPU + transformers installed, numba CUDA simulator): a tiny random model, the
integration's selection and output against HF's, generation, fallbacks. GPU tier (``-m gpu``): the
real QSA geometry on 4096-token prompts, float32 and bfloat16, greedy generation.
Skipped without torch / transformers (CI has neither).
"""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

import oracle  # noqa: E402
from numqsa.integrations import transformers as nt  # noqa: E402
from numqsa.jit import SIMULATOR  # noqa: E402
from numqsa.testing import TOLERANCES, assert_selection_matches, compare  # noqa: E402

R = 4  # compress ratio of every Qwen4Exp checkpoint

# Tiny: index 2 x 16, budget 4 tokens (Kb = 1) so that 9 tokens already select; attention 4 / 2 / 32.
TINY = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, hc_count=2, hc_lowrank=8, indexer_n_heads=2,
            indexer_head_dim=16, indexer_budget=4, max_position_embeddings=256)
# The production QSA geometry (indexer 4 x 128, budget 2048 = Kb 512; attention 24 / 2 / 256, partial
# rotary 0.25, theta 1e7); everything outside QSA small (vocab, experts).
REAL = dict(vocab_size=1024, hidden_size=2048, num_attention_heads=24, num_key_value_heads=2,
            head_dim=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
            shared_expert_intermediate_size=256, indexer_n_heads=4, indexer_head_dim=128,
            indexer_budget=2048, max_position_embeddings=32768)


def make_model(geometry, layer_types=("qwen_sparse_attention",), dtype=torch.float32, device="cpu",
               seed=0, attn_implementation="sdpa"):
    cfg = Qwen4ExpTextConfig(**geometry, num_hidden_layers=len(layer_types),
                             layer_types=list(layer_types), indexer_kv_heads=1,
                             indexer_compress_ratio=R,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                              "partial_rotary_factor": 0.25})
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = modeling.Qwen4ExpTextModel(cfg).eval()
    # HF initialises the norms' weights to 0 (scale 1): random weights exercise the (1 + w) terms.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "norm" in name.split(".")[-2]:
                p.normal_(0.0, 0.3)
    freqs = [(m, m.inv_freq.clone()) for m in model.modules() if hasattr(m, "inv_freq")]
    model = model.to(device=device, dtype=dtype)
    for m, f in freqs:      # as from_pretrained leaves them: float32 RoPE frequencies in any dtype
        m.inv_freq = f.to(device)
    return model


class Capture:
    """HF's indexer calls of one QSA layer: inputs and the selection mask HF returned."""

    def __init__(self, indexer):
        self.calls = []
        self.handle = indexer.register_forward_hook(self.hook)

    def hook(self, module, args, output):
        hs, pe, mask = args[:3]
        self.calls.append(dict(hidden=hs.detach(), pe=tuple(x.detach() for x in pe),
                               mask=mask.detach(), selected=output.detach()))

    def remove(self):
        self.handle.remove()


def groups_from_tokens(tokens, counts, nb, Kb):
    """The complete groups of each row's token list (its tail, ``r*nb ..``, left out), ``-1`` padded."""
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    groups = np.full((tokens.shape[0], Kb), -1, np.int64)
    for i in range(tokens.shape[0]):
        t = np.sort(tokens[i, :counts[i]])
        g = np.unique(t[t < R * nb[i]] // R)
        groups[i, :g.size] = g
    return groups


def hf_tokens(selected, attention_mask):
    """HF's selected token ids per row from its indexer's mask (``&`` the causal mask), ascending."""
    vis = attention_mask[0, 0] if attention_mask.dtype == torch.bool else attention_mask[0, 0] == 0
    sel = selected[0, 0]
    sel = (sel if sel.dtype == torch.bool else sel == 0) & vis
    counts = sel.sum(-1).cpu().numpy().astype(np.int32)
    nz = torch.nonzero(sel).cpu().numpy()            # row-major: each row's ids ascending
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tokens = np.full((sel.shape[0], max(int(counts.max(initial=0)), 1)), -1, np.int32)
    tokens[nz[:, 0], np.arange(nz.shape[0]) - start[nz[:, 0]]] = nz[:, 1]
    return tokens, counts


def selection_report(indexer, call, tokens, counts):
    """Spec §8 for numqsa's and HF's selections of one prefill call (batch 1), against the float64
    scores of HF's own index values; returns the number of rows where the two choose differently."""
    with torch.no_grad():
        qi, kc = nt.index_inputs(indexer, call["hidden"], call["pe"])
    S, skv = qi.shape[1], call["mask"].shape[-1]
    Kb = indexer.block_topk
    pos = np.arange(skv - S, skv, dtype=np.int32)
    req, lens = np.zeros(S, np.int32), np.array([skv], np.int32)
    G = kc.shape[1]
    cache = kc.double().cpu().numpy() if G else np.zeros((1, 1, kc.shape[2]))
    scores = oracle.index_scores(qi[0].double().cpu().numpy(), cache, np.zeros((1, 1), np.int32),
                                 req, pos, lens, r=R)
    _, _, _, nb = oracle.row_states(req, pos, lens, R)
    ours = groups_from_tokens(tokens, counts, nb, Kb)
    assert_selection_matches(ours, np.asarray(tokens), np.asarray(counts), scores, req, pos, lens,
                             Kb=Kb)
    ht, hc = hf_tokens(call["selected"], call["mask"])
    theirs = groups_from_tokens(ht, hc, nb, Kb)
    want_t, want_c = oracle.expand_tokens(theirs, req, pos, lens, r=R)
    np.testing.assert_array_equal(hc, want_c, err_msg="HF's counts")
    np.testing.assert_array_equal(ht, want_t[:, :ht.shape[1]], err_msg="HF's tokens (tail)")
    assert_selection_matches(theirs, want_t, want_c, scores, req, pos, lens, Kb=Kb)
    return int((ours != theirs).any(axis=1).sum())


# Two float64 scores closer than this (relative) are a tie for an engine that sums Hi x Di products in
# float32 in its own order (2^-20 ~ 1e-6: a few float32 ulps of the sum).
TIE = 2.0 ** -20


def chain_report(model, call, rounding):
    """HF's index values and selection of one call (batch 1, causal) against the oracle's emulation
    of HF's rounding chain (``rounding``, e.g. ``"hf-bf16"``) from HF's raw projections.

    Returns the fraction of index-query / key elements the emulation reproduces bit for bit, the
    sparse rows, the rows where HF chose a group that the emulated chain does not tie with its
    ``Kb``-th best (must be none but for the rare element the emulation misses by an ulp), and the
    rows where HF's choice leaves the spec's 1e-4 band of the float64 truth."""
    from oracle import rounding as chains
    indexer = nt._qsa_modules(model)[0].indexer
    with torch.no_grad():
        qi, kc = nt.index_inputs(indexer, call["hidden"], call["pe"])
        hi, di = indexer.index_n_heads, indexer.index_head_dim
        q, k = indexer.index_qk_proj(call["hidden"]).split([hi * di, di], dim=-1)
    S, G, Kb = q.shape[1], kc.shape[1], indexer.block_topk
    rot, theta = call["pe"][0].shape[-1], float(model.config.rope_parameters["rope_theta"])
    q_raw, k_raw = q[0].reshape(S, hi, di).double().cpu().numpy(), k[0].double().cpu().numpy()
    w_q = indexer.q_layernorm.weight.detach().double().cpu().numpy()
    w_k = indexer.k_layernorm.weight.detach().double().cpu().numpy()
    eps = indexer.q_layernorm.eps
    pos = np.arange(S)
    q_e = chains.index_queries(q_raw, w_q, pos, rounding=rounding, eps=eps, rot=rot, theta=theta)
    k_e = chains.index_keys(k_raw[:G * R].reshape(G, R, di), w_k, R * np.arange(G), rounding=rounding,
                            eps=eps, rot=rot, theta=theta)
    q_hf, k_hf = qi[0].double().cpu().numpy(), kc[0].double().cpu().numpy()
    req, lens = np.zeros(S, np.int32), np.array([S], np.int32)
    table = np.zeros((1, 1), np.int32)
    s_e = oracle.index_scores(q_e, k_e[None], table, req, pos, lens, r=R)
    q_t = oracle.index_queries(q_raw, w_q, req, pos, lens, eps=eps, rot=rot, theta=theta)
    k_t = oracle.rope(oracle.gnorm(k_raw[:G * R].reshape(G, R, di).mean(axis=1), w_k, eps),
                      R * np.arange(G), rot, theta)
    s_t = oracle.index_scores(q_t, k_t[None], table, req, pos, lens, r=R)
    _, _, _, nb = oracle.row_states(req, pos, lens, R)
    ht, hc = hf_tokens(call["selected"], call["mask"])
    hf_groups = groups_from_tokens(ht, hc, nb, Kb)
    sparse = np.flatnonzero(nb > Kb)
    not_tie, outside = [], []
    for i in sparse:
        chosen = np.zeros(nb[i], bool)
        chosen[hf_groups[i][hf_groups[i] >= 0]] = True
        for s, band, bad in ((s_e[i, :nb[i]], TIE, not_tie), (s_t[i, :nb[i]], 1e-4, outside)):
            s_k = np.sort(s)[::-1][Kb - 1]
            eps_i = band * max(1.0, abs(s_k))
            if (~chosen & (s > s_k + eps_i)).any() or (chosen & (s < s_k - eps_i)).any():
                bad.append(int(i))
    return dict(q_equal=float((q_e == q_hf).mean()), k_equal=float((k_e == k_hf).mean()),
                sparse_rows=int(sparse.size), not_tie=not_tie, outside_truth_band=len(outside))


def run_both(model, ids, **kw):
    """HF's output and selection, then numqsa's, on the same model and input."""
    attn = nt._qsa_modules(model)[0]
    cap = Capture(attn.indexer)
    with torch.no_grad():
        ref = model(ids, **kw).last_hidden_state
        cap.remove()
        nt.enable(model, keep_selection=True)
        try:
            got = model(ids, **kw).last_hidden_state
        finally:
            selection = attn.numqsa_selection
            nt.disable(model)
    return ref, got, cap.calls[0], selection


# ---- simulator tier --------------------------------------------------------------------------------

@pytest.mark.skipif(not SIMULATOR, reason="tiny CPU case for the numba CUDA simulator")
def test_prefill_matches_hf_sim(seed):
    model = make_model(TINY, seed=seed)
    ids = torch.randint(0, TINY["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(seed))
    ref, got, call, (tokens, counts) = run_both(model, ids, use_cache=True)
    attn = nt._qsa_modules(model)[0]
    assert selection_report(attn.indexer, call, tokens, counts) == 0
    st = compare(got.numpy(), ref.double().numpy())
    assert st["rel_l2"] <= TOLERANCES["float32"].rel_l2, st


@pytest.mark.skipif(not SIMULATOR, reason="tiny CPU case for the numba CUDA simulator")
def test_greedy_generation_matches_hf_sim(seed):
    model = make_model(TINY, seed=seed)
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(seed))
    want, got = generate_both(_causal_lm(model), ids, new_tokens=3)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def generate_both(lm, ids, new_tokens):
    """Greedy tokens of HF, then of HF + numqsa (checked to have run numqsa, prefill and decode)."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
    # An explicit all-ones mask: without one, generate() masks every prompt token equal to the pad
    # id (a random prompt has some), a mask that is not a prefix and so HF's path by design.
    mask = torch.ones_like(ids)
    attn = nt._qsa_modules(lm)[0]
    before = lm.config._attn_implementation
    with torch.no_grad():
        want = lm.generate(ids, attention_mask=mask, generation_config=gen)
        nt.enable(lm, keep_selection=True)
        assert lm.config._attn_implementation == nt.NAME
        nt._warned.clear()          # a fallback warned earlier in the session warns here again
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = lm.generate(ids, attention_mask=mask, generation_config=gen)
        fell_back = [str(x.message) for x in w if str(x.message).startswith("numqsa:")]
        assert hasattr(attn, "numqsa_selection"), f"no call went through numqsa: {fell_back}"
        rows = attn.numqsa_selection[1].shape[0]
        nt.disable(lm)
    assert not fell_back, fell_back
    assert rows == 1, "the last step (a decode step) did not run through numqsa"
    assert lm.config._attn_implementation == before
    return want, got


@pytest.mark.slow
@pytest.mark.skipif(not SIMULATOR, reason="tiny CPU case for the numba CUDA simulator")
@pytest.mark.parametrize("bf16_as", ["float32", "float16"])
def test_bfloat16_model_sim(seed, bf16_as):
    # bf16 runs as float32 (exact) or float16: the selection is HF's but for near-ties, the output
    # within twice HF's own bf16 error against the float32 model of the same weights.
    model = make_model(TINY, seed=seed, dtype=torch.bfloat16, attn_implementation="eager")
    f32 = make_model(TINY, seed=seed, attn_implementation="eager")
    with torch.no_grad():
        for a, b in zip(f32.parameters(), model.parameters()):
            a.copy_(b.float())
    ids = torch.randint(0, TINY["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(seed))
    attn = nt._qsa_modules(model)[0]
    cap = Capture(attn.indexer)
    with torch.no_grad():
        ref = model(ids).last_hidden_state
        cap.remove()
        nt.enable(model, keep_selection=True, bf16_as=bf16_as)
        got = model(ids).last_hidden_state
        tokens, counts = attn.numqsa_selection
        nt.disable(model)
        truth = f32(ids).last_hidden_state.double().numpy()
    assert got.dtype == torch.bfloat16
    selection_report(attn.indexer, cap.calls[0], tokens, counts)
    hf_err = compare(ref.double().numpy(), truth)["rel_l2"]
    ours = compare(got.double().numpy(), truth)
    assert ours["finite"] and ours["rel_l2"] <= 2 * hf_err, (ours, hf_err)


@pytest.mark.slow
@pytest.mark.skipif(not SIMULATOR, reason="tiny CPU case for the numba CUDA simulator")
def test_right_padded_batch_matches_hf_sim(seed):
    # Two requests, the second right-padded: every mask row sees a prefix, so numqsa takes it
    # (request ids, one page per request, pad rows at position len - 1).
    model = make_model(TINY, seed=seed)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        nt.enable(model, keep_selection=True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = model(ids, attention_mask=mask).last_hidden_state
        _, counts = nt._qsa_modules(model)[0].numqsa_selection
        nt.disable(model)
    assert not [x for x in w if str(x.message).startswith("numqsa:")], [str(x.message) for x in w]
    # selected tokens per row: all visible ones up to 7 (Kb*r + r - 1), then one group + the tail
    np.testing.assert_array_equal(np.asarray(counts), [*range(1, 8), 4, 5, *range(1, 7), 6, 6, 6])
    st = compare(got.numpy(), want.double().numpy())
    assert st["rel_l2"] <= TOLERANCES["float32"].rel_l2, st


def _causal_lm(text_model):
    """A ``Qwen4ExpForCausalLM`` around ``text_model``'s weights (random head)."""
    lm = modeling.Qwen4ExpForCausalLM(text_model.config).eval()
    lm.model.load_state_dict(text_model.state_dict())
    return lm.to(dtype=next(text_model.parameters()).dtype, device=text_model.device)


@pytest.mark.skipif(not SIMULATOR, reason="tiny CPU case for the numba CUDA simulator")
def test_left_padding_falls_back_with_a_warning_sim(seed):
    model = make_model(TINY, seed=seed)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        nt.enable(model)
        nt._warned.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = model(ids, attention_mask=mask).last_hidden_state
        nt.disable(model)
    assert any("left padding" in str(x.message) for x in w), [str(x.message) for x in w]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_oracle_reproduces_hf_rounding_chain_cpu(dtype):
    # The real index geometry (4 x 128, rot 64) on 600 tokens, Kb 64: no numqsa kernel involved.
    geometry = dict(TINY, indexer_n_heads=4, indexer_head_dim=128, indexer_budget=256, head_dim=256,
                    max_position_embeddings=4096)
    model = make_model(geometry, dtype=dtype)
    cap = Capture(nt._qsa_modules(model)[0].indexer)
    ids = torch.randint(0, geometry["vocab_size"], (1, 600), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model(ids)
    rep = chain_report(model, cap.calls[0], "hf-bf16" if dtype == torch.bfloat16 else "hf-fp32")
    if dtype == torch.bfloat16:   # float32 libm and sum-order ulps rarely cross a bf16 rounding
        assert rep["q_equal"] > 0.999 and rep["k_equal"] > 0.999, rep
    assert rep["sparse_rows"] > 300 and not rep["not_tie"], rep


def test_unsupported_reasons():
    model = make_model(TINY)
    attn = nt._qsa_modules(model)[0]
    h = torch.zeros(1, 4, TINY["hidden_size"], dtype=torch.float64)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    assert "dtype" in nt._why_unsupported(attn, h, mask) or not SIMULATOR
    assert "heads" in nt._why_unsupported(attn, h.float(), mask.expand(1, 2, 4, 4))
    counts, why = nt.visible_prefix(mask)
    assert why == "" and counts.tolist() == [[1, 2, 3, 4]]
    left = mask.clone()
    left[0, 0, :, 0] = False
    assert nt.visible_prefix(left)[0] is None
    right = mask.clone()
    right[0, 0, :, 3] = False                    # right padding: the last key is a pad
    assert nt.visible_prefix(right)[0].tolist() == [[1, 2, 3, 3]]
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    assert nt.visible_prefix(additive)[0].tolist() == [[1, 2, 3, 4]]


def test_pages_view_declares_whole_groups():
    x = torch.arange(2 * 3 * 6 * 5, dtype=torch.float32).reshape(2, 3, 6, 5)   # [B, Hkv, S, D]
    v = nt._StridedView(x, (2, 8, 3, 5), (90, 5, 30, 1)).__cuda_array_interface__
    assert v["shape"] == (2, 8, 3, 5) and v["strides"] == (360, 20, 120, 4)
    assert v["data"][0] == x.data_ptr() and v["typestr"] == "<f4"
    pages = nt._pages(x, R)                       # CPU: the simulator's padded NumPy copy
    assert pages.shape == (2, 8, 3, 5)
    np.testing.assert_array_equal(pages[:, :6], x.transpose(1, 2).numpy())


def test_enable_disable_round_trip():
    model = make_model(TINY)
    attn = nt._qsa_modules(model)[0]
    nt.enable(model)
    assert nt.is_enabled(model) and "forward" in attn.indexer.__dict__
    assert model.config._attn_implementation == nt.NAME
    nt.disable(model)
    assert not nt.is_enabled(model) and "forward" not in attn.indexer.__dict__
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError):
        nt.enable(torch.nn.Linear(2, 2))
    # an instance-level forward already there (accelerate's hooks) is HF's path and comes back
    hf = attn.indexer.forward
    attn.indexer.forward = hf
    nt.enable(model)
    assert nt.is_enabled(model) and attn.indexer.forward is not hf
    nt.disable(model)
    assert attn.indexer.__dict__["forward"] is hf


# ---- GPU tier (the lead runs these on an H200) ----------------------------------------------------

def _prompt(vocab, n, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_types", [("qwen_sparse_attention",),
                                         ("linear_attention", "qwen_sparse_attention")],
                         ids=["1-layer", "2-layer"])
def test_real_geometry_float32_matches_hf_gpu(seed, layer_types):
    model = make_model(REAL, layer_types=layer_types, device="cuda", seed=seed)
    ids = _prompt(REAL["vocab_size"], 4096, seed)
    ref, got, call, (tokens, counts) = run_both(model, ids, use_cache=False)
    indexer = nt._qsa_modules(model)[0].indexer
    differ = selection_report(indexer, call, tokens.cpu().numpy(), counts.cpu().numpy())
    st = compare(got.double().cpu().numpy(), ref.double().cpu().numpy())
    print(f"rows choosing differently from HF (all inside the §8 band): {differ} of {ids.shape[1]}; "
          f"output rel-L2 {st['rel_l2']:.2e}")
    assert st["finite"] and st["rel_l2"] <= 1e-3, st


@pytest.mark.gpu
def test_real_geometry_bfloat16_against_hf_chain_gpu(seed):
    """bf16: numqsa selects on HF's exact bf16 index values (upcast to float32), so it chooses as HF
    does but for float32 near-ties; the oracle's emulated HF chain reproduces HF's choice but for
    ties; the output stays within twice HF's own bf16 error against the float32 model."""
    model = make_model(REAL, dtype=torch.bfloat16, device="cuda", seed=seed,
                       attn_implementation="eager")
    ids = _prompt(REAL["vocab_size"], 4096, seed)
    ref, got, call, (tokens, counts) = run_both(model, ids, use_cache=False)
    indexer = nt._qsa_modules(model)[0].indexer
    differ = selection_report(indexer, call, tokens.cpu().numpy(), counts.cpu().numpy())
    rep = chain_report(model, call, "hf-bf16")
    print(f"numqsa vs HF bf16: {differ} rows differ (inside the band); chain: {rep['q_equal']:.5f} / "
          f"{rep['k_equal']:.5f} of q / k bitwise, {len(rep['not_tie'])} of {rep['sparse_rows']} "
          f"sparse rows beyond ties, HF outside the float64 1e-4 band on "
          f"{rep['outside_truth_band']} rows")
    assert rep["q_equal"] > 0.999 and rep["k_equal"] > 0.999, rep
    assert len(rep["not_tie"]) <= rep["sparse_rows"] // 1000, rep["not_tie"][:10]
    f32 = make_model(REAL, dtype=torch.float32, device="cuda", seed=seed, attn_implementation="eager")
    with torch.no_grad():
        truth = f32(ids, use_cache=False).last_hidden_state.double().cpu().numpy()
    hf_err = compare(ref.double().cpu().numpy(), truth)["rel_l2"]
    ours = compare(got.double().cpu().numpy(), truth)
    print(f"rel-L2 against the float32 model: HF bf16 {hf_err:.2e}, HF + numqsa bf16 "
          f"{ours['rel_l2']:.2e}")
    assert ours["finite"] and ours["rel_l2"] <= 2 * hf_err, (ours, hf_err)


@pytest.mark.gpu
def test_greedy_generation_matches_hf_eager_gpu(seed):
    model = make_model(REAL, seed=seed, attn_implementation="eager")
    lm = _causal_lm(model).to("cuda")
    ids = _prompt(REAL["vocab_size"], 2501, seed)     # past 2051: sparse from the first row on
    want, got = generate_both(lm, ids, new_tokens=32)
    np.testing.assert_array_equal(got.cpu().numpy(), want.cpu().numpy())
    assert got.shape[1] == ids.shape[1] + 32


# ---- two GPUs (``-m multi_gpu``; skipped with fewer) ---------------------------------------------

def _two_gpu_map(model):
    """A ``device_map`` putting the first decoder layer and everything but the layers on cuda:0 and
    every later layer on cuda:1 (each entry gets accelerate's hook moving its inputs there)."""
    path = next(n for n, m in model.named_modules()
                if n.split(".")[-1] == "layers" and isinstance(m, torch.nn.ModuleList)).split(".")
    device_map = {}
    for depth in range(len(path)):
        parent = ".".join(path[:depth])
        for name, _ in model.get_submodule(parent).named_children():
            full = f"{parent}.{name}" if parent else name
            if full != ".".join(path[:depth + 1]):
                device_map[full] = 0
    layers = ".".join(path)
    for i in range(len(model.get_submodule(layers))):
        device_map[f"{layers}.{i}"] = min(i, 1)
    return device_map


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_device_map_two_gpus_bitwise_equal_one_gpu(seed):
    """Two QSA layers of the real geometry, layer 0 on cuda:0 and layer 1 on cuda:1 (accelerate's
    ``dispatch_model``, what ``from_pretrained(device_map=...)`` runs), through numqsa: the prefill
    logits and greedy generation bitwise equal to the same model on one GPU, each layer's selection
    made on its own device."""
    import copy
    accelerate = pytest.importorskip("accelerate")
    layers = ("qwen_sparse_attention", "qwen_sparse_attention")
    cpu = _causal_lm(make_model(REAL, layer_types=layers, seed=seed, attn_implementation="eager"))
    one = copy.deepcopy(cpu).to("cuda:0")
    split = accelerate.dispatch_model(copy.deepcopy(cpu), device_map=_two_gpu_map(cpu))
    attns = nt._qsa_modules(split)
    assert [{p.device.index for p in a.parameters()} for a in attns] == [{0}, {1}]
    ids = _prompt(REAL["vocab_size"], 2501, seed)     # past 2051: sparse from the first row on
    logits, tokens = {}, {}
    for name, lm in (("one", one), ("split", split)):
        nt.enable(lm, keep_selection=True)
        try:
            with torch.no_grad():
                logits[name] = lm(ids, use_cache=False).logits.cpu().numpy()
            if name == "split":
                assert [a.numqsa_selection[0].device.index for a in attns] == [0, 1]
        finally:
            nt.disable(lm)
        tokens[name] = generate_both(lm, ids, new_tokens=16)[1].cpu().numpy()
    assert torch.cuda.current_device() == 0
    np.testing.assert_array_equal(logits["split"], logits["one"])
    np.testing.assert_array_equal(tokens["split"], tokens["one"])


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_tp_plan_two_processes_like_one_gpu(seed, tmp_path):
    """The model under its own tensor-parallel plan (``tp_plan="auto"``, two processes of
    ``tests/multi_gpu_torchrun.py``): numqsa against HF's attention differs no more than on one GPU.
    Sharded matmuls round differently from one GPU's (not bitwise), and that rounding reaches both
    paths' inputs, so the bound is twice the one-GPU difference: a layer run on the wrong device or
    with the wrong heads differs by orders of magnitude more."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    model_dir = tmp_path / "model"
    make_model(REAL, layer_types=("qwen_sparse_attention", "qwen_sparse_attention"),
               seed=seed).save_pretrained(model_dir)
    ids = _prompt(REAL["vocab_size"], 4096, seed, device="cpu")
    np.save(model_dir / "ids.npy", ids.numpy())
    script = Path(__file__).with_name("multi_gpu_torchrun.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), "--out", str(tmp_path), "--parts", "hf", "--model", str(model_dir)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    tp = np.load(tmp_path / "hf-tp.npz")
    one = modeling.Qwen4ExpTextModel.from_pretrained(model_dir, dtype=torch.float32).to("cuda:0")
    with torch.no_grad():
        ref = one.eval()(ids.cuda(), use_cache=False).last_hidden_state
        nt.enable(one)
        try:
            got = one(ids.cuda(), use_cache=False).last_hidden_state
        finally:
            nt.disable(one)
    one_gpu = compare(got.double().cpu().numpy(), ref.double().cpu().numpy())
    two = compare(tp["numqsa"].astype(np.float64), tp["hf"].astype(np.float64))
    print(f"numqsa vs HF, rel-L2: one GPU {one_gpu['rel_l2']:.2e}, tp_plan over two GPUs "
          f"{two['rel_l2']:.2e}")
    assert one_gpu["finite"] and two["finite"], (one_gpu, two)
    assert two["rel_l2"] <= 2 * one_gpu["rel_l2"], (two, one_gpu)
