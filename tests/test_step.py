"""The runtime's step: one write path and one mask, whether its start is a Python int, one
device position for every row (the static decode step) or a device position per row."""
import pytest
import torch

import rewriter
from rewriter.maths.mask import visible
from rewriter.ops import attention_mask
from rewriter.runtime.attention import Step, cached_attention
from rewriter.runtime.kv_cache import CacheSpec, KVCache

SPEC = CacheSpec(id=0, num_heads=4, num_kv_heads=2, head_dim=8, scale=0.3, causal=True, window=None)


def _cache(batch: int = 3) -> KVCache:
    cache = KVCache({0: SPEC}, batch, 16, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    cache.k[0][:], cache.v[0][:] = torch.randn(batch, 2, 16, 8), torch.randn(batch, 2, 16, 8)
    return cache


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("start", ["scalar", "rows"])
def test_a_device_start_writes_and_masks_as_an_int_start(window, start):
    """A one-token step at position 9 under padding: the same cache and output whether 9
    is an int (keys read up to 10) or on the device (keys read up to the cache's length)."""
    pad = torch.tensor([0, 2, 5])
    q, k, v = torch.randn(3, 1, 32), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    spec = CacheSpec(**{**SPEC.__dict__, "window": window})
    host, device = _cache(), _cache()
    want = cached_attention(Step(host, 9, 1, pad), q, k, v, spec)
    at = torch.tensor(9) if start == "scalar" else torch.tensor([9, 9, 9])
    got = cached_attention(Step(device, at, 1, pad, end=16), q, k, v, spec)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(device.k[0], host.k[0]) and torch.equal(device.v[0], host.v[0])
    assert torch.equal(device.k[0][:, :, 9], k.view(3, 2, 8))  # written where it belongs


def test_a_device_start_needs_its_end():
    with pytest.raises(ValueError, match="needs its end"):
        Step(_cache(), torch.tensor(4), 1, None)


def test_the_mask_hides_padding_but_a_padding_query_sees_itself():
    q, k = torch.arange(4)[:, None], torch.arange(4)[None]
    mask = visible(q, k, window=2, first_real=torch.tensor(2))
    assert mask.tolist() == [[True, False, False, False], [False, True, False, False],
                             [False, False, True, False], [False, False, True, True]]
    # the reference's mask is the same function: the last 2 of 5 keys, a window of 2 and a sink
    assert attention_mask(2, 5, 2, "cpu", sinks=1).tolist() == [
        [True, False, True, True, False], [True, False, False, True, True]]


def test_lowered_attention_names_its_attributes_in_one_object():
    """The dumped program shows each attention's ``CacheSpec``, an attribute of the program
    read once per step (not built by every call), and the code runs as shown."""
    model = rewriter.from_pretrained("default")
    code = model.programs()["decode"]
    assert "# self.cache0 = CacheSpec(id=0, num_heads=" in code
    assert "cache0 = self.cache0" in code and "cached_attention(step, " in code
    assert "CacheSpec(" not in code.split("def forward")[1]
    assert model.generate([[1, 2, 3]], max_new_tokens=3).shape == (1, 6)


def test_the_cache_lease_is_one_at_a_time_and_a_stale_release_frees_nothing():
    """``KVCache.hold`` is the one lease: a second is refused by name, a release hands back
    only its own lease, and a freed cache fits again."""
    cache = _cache()
    release = cache.hold()
    assert not cache.fits(3, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(rewriter.RewriterError, match="held by a generation in progress"):
        cache.hold()
    release()
    again = cache.hold()
    release()  # the first lease's release, late: the second lease stays
    assert cache.busy
    again()
    assert cache.fits(3, 16, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("start, end, message", [
    (torch.tensor(2.0), 8, "integer"), (torch.zeros(2, 2, dtype=torch.long), 8, "integer"),
    (2.0, None, "an int or a device tensor"), (True, None, "an int or a device tensor"),
    (torch.tensor(2), None, "needs its end"), (4, 5, "short of its tokens")])
def test_a_step_refuses_starts_and_ends_that_would_index_the_cache_wrongly(start, end, message):
    with pytest.raises(ValueError, match=message):
        Step(_cache(), start, 2, None, end=end)


def test_a_tree_step_at_a_device_scalar_start_masks_as_at_an_int_start():
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1])
    host = Step(_cache(), 4, 3, None, tree=tree, depth=depth).mask(2)
    device = Step(_cache(), torch.tensor(4), 3, None, end=7, tree=tree, depth=depth).mask(2)
    assert torch.equal(host.expand_as(device), device)
