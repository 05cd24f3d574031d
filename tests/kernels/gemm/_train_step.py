"""One optimizer step of a model on (x, dy), shared by the NVFP4Linear compile and capturable tests."""

from __future__ import annotations


def train_step(model, opt, x, dy):
    """Forward ``x``, backward ``dy``, one ``opt`` step: ``(y, [dx, *parameter grads])`` before the step."""
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return y.detach(), grads
