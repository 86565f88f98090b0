"""Lab 05 graders: a correct answer passes, an unfinished one fails, each typical mistake is named."""

import pytest
import torch

from labkit.grading.core import get_exercise, run_exercise
from labkit.grading.labs import lab05


def outcome(name, fn):
    return run_exercise(get_exercise("05", name), {name: fn})


def assert_fails(name, fn, message):
    result = outcome(name, fn)
    assert not result.passed and message in result.message, result.message


def not_done(*args):
    raise NotImplementedError()


# ---- rms_norm


def rms_good(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


@pytest.mark.parametrize(("fn", "message"), [
    (not_done, "not implemented"),
    (lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w, "add eps inside the square root"),
    (lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), "weight was not applied"),
    (lambda x, w, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps) * w, "RMSNorm does not subtract"),
    (lambda x, w, eps: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w, "*sum* of squares"),
    (lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w, "eps was added after"),
    (lambda x, w, eps: rms_good(x, w, eps).float(), "fp16 input return fp16"),
])
def test_rms_norm_mistakes(fn, message):
    assert_fails("rms_norm", fn, message)


def test_rms_norm_correct():
    assert outcome("rms_norm", rms_good).passed


# ---- apply_rotary


def rotary_good(x, positions, theta):
    return lab05._rotary(x, positions, theta).float()


@pytest.mark.parametrize(("fn", "message"), [
    (not_done, "not implemented"),
    (lambda x, p, theta: x, "unchanged"),
    (lambda x, p, theta: lab05._rotary(x, p, theta, interleaved=True).float(), "neighbouring pairs"),
    (lambda x, p, theta: lab05._rotary(x, p, theta, sign=-1.0).float(), "wrong way"),
    (lambda x, p, theta: lab05._rotary(x, p, theta, exponent=1).float(), "wrong frequencies"),
    (lambda x, p, theta: lab05._rotary(x, p, 10000.0).float(), "theta was ignored"),
    (lambda x, p, theta: lab05._rotary(x, p + 1, theta).float(), "differs from labkit's"),
    (lambda x, p, theta: x[:, :, :4], "should have shape"),
])
def test_apply_rotary_mistakes(fn, message):
    assert_fails("apply_rotary", fn, message)


def test_apply_rotary_correct():
    assert outcome("apply_rotary", rotary_good).passed


# ---- attention_with_cache


def make_attention(*, scale=True, align_end=True, interleave=True, append=True, front=False):
    def attention_with_cache(q, k_new, v_new, cache):
        cached = cache["k"].shape[1]
        k_t, v_t = k_new.transpose(0, 1), v_new.transpose(0, 1)
        if append:
            order = (lambda old, new: (new, old)) if front else (lambda old, new: (old, new))
            cache["k"] = torch.cat(order(cache["k"], k_t), dim=1)
            cache["v"] = torch.cat(order(cache["v"], v_t), dim=1)
        k_all, v_all = torch.cat([cache["k"][:, :cached], k_t], 1), torch.cat([cache["v"][:, :cached], v_t], 1)
        if front:
            k_all, v_all = cache["k"], cache["v"]
        return lab05._attend(q, k_all.transpose(0, 1), v_all.transpose(0, 1), cached, scale=scale,
                             align_end=align_end, interleave=interleave)

    return attention_with_cache


def no_mask_attention(q, k_new, v_new, cache):
    cache["k"] = torch.cat([cache["k"], k_new.transpose(0, 1)], 1)
    cache["v"] = torch.cat([cache["v"], v_new.transpose(0, 1)], 1)
    k = cache["k"].repeat_interleave(3, 0)
    v = cache["v"].repeat_interleave(3, 0)
    w = (q.transpose(0, 1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5).softmax(-1)
    return (w @ v).transpose(0, 1)


@pytest.mark.parametrize(("fn", "message"), [
    (not_done, "not implemented"),
    (make_attention(append=False), "append k_new"),
    (make_attention(front=True), "position order"),
    (make_attention(scale=False), "sqrt(head_dim)"),
    (make_attention(interleave=False), "repeat_interleave"),
    (make_attention(align_end=False), "aligned to the first key"),
    (no_mask_attention, "causal mask"),
    (lambda q, k, v, cache: q[:, :2], "should have shape"),
])
def test_attention_with_cache_mistakes(fn, message):
    assert_fails("attention_with_cache", fn, message)


def test_attention_with_cache_correct():
    assert outcome("attention_with_cache", make_attention()).passed
