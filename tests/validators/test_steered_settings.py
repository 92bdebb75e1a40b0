"""The replays of the loop's hooks leave the optimizer as they found it (validators/steered_settings.py,
``replay_records``): a replayed hook that rebinds a group's parameters (a new head put in the optimizer), edits the list
in place or adds a group puts nothing there that the real run did not."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.validators.steered_settings import replay_records


def test_a_replay_that_rebinds_edits_or_adds_parameter_groups_is_put_back():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    group, params = opt.param_groups[0], opt.param_groups[0]["params"]
    held = list(params)
    other = nn.Linear(2, 2)

    def rebinds() -> None:
        opt.param_groups[0]["params"] = list(other.parameters())

    def edits() -> None:
        opt.param_groups[0]["params"].append(other.weight)

    def adds() -> None:
        opt.add_param_group({"params": list(model[1].parameters()), "lr": 1.0})

    replay_records(opt, [rebinds, edits, adds])
    assert len(opt.param_groups) == 1 and opt.param_groups[0] is group
    assert group["params"] is params and all(a is b for a, b in zip(params, held)) and len(params) == len(held)
    assert group["lr"] == 0.1


def test_an_optimizer_state_tensor_at_a_freed_ones_address_is_a_change():
    """The optimizer's state tensors are tokened by identity, shape and version, and the fingerprint holds them: a
    state rebound to a new tensor of the same shape, after the old one is freed, is not taken for it."""
    from lightning_dp.fingerprints.fingerprint_entries import changed_entries
    from lightning_dp.validators.steered_settings import hyperparameters

    p = nn.Parameter(torch.zeros(64))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["kept"] = torch.zeros(64)
    before = hyperparameters(opt)
    freed = id(opt.state[p]["kept"])
    opt.state[p]["kept"] = None
    made = [torch.zeros(64) for _ in range(500)]  # CPython hands a freed object's memory to the next one of its size
    opt.state[p]["kept"] = next((t for t in made if id(t) == freed), made[0])
    assert "optimizer state[0][0].kept" in changed_entries(before, hyperparameters(opt))


def test_the_optimizer_state_compared_as_rows_names_what_the_entries_name():
    """A release compares the optimizer as :class:`OptimizerState` rows, naming entries only when the rows differ: it
    finds what :func:`hyperparameters` compared entry by entry finds (an in-place write to a moment, a moment rebound
    at a freed one's address, a new state key, a non-tensor state value, a learning rate, a group added, a parameter
    left out), and nothing when nothing changed."""
    from lightning_dp.fingerprints.fingerprint_entries import changed_entries
    from lightning_dp.validators.steered_settings import OptimizerState, hyperparameters

    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model[:2].parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    w = model[0].weight

    def rebind() -> None:
        freed = id(opt.state[w]["exp_avg"])
        opt.state[w]["exp_avg"] = None
        made = [torch.zeros(8, 4) for _ in range(500)]
        opt.state[w]["exp_avg"] = next((t for t in made if id(t) == freed), made[0])

    def add_group() -> None:
        opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})

    writes = {"none": lambda: None, "in place": lambda: opt.state[w]["exp_avg"].add_(1.0), "rebound": rebind,
              "new key": lambda: opt.state[w].__setitem__("kept", torch.ones(2)),
              "value": lambda: opt.state[w].__setitem__("scale", 2.0), "lr": lambda: opt.param_groups[0].update(lr=1),
              "group": add_group, "left out": lambda: opt.param_groups[0]["params"].pop(1)}
    for name, write in writes.items():
        opt.state[w]["scale"] = 1.0
        before, rows = hyperparameters(opt), OptimizerState(opt)
        write()
        expected = changed_entries(before, hyperparameters(opt))
        assert rows.changed(OptimizerState(opt)) == expected, name
        assert bool(expected) == (name != "none"), name
        assert rows.entries() == before, name


def test_an_optimizer_read_again_in_the_same_layout_still_finds_every_write():
    """:class:`OptimizerState` reads an optimizer whose state is laid out as at its last full read (the same parameters,
    state dicts, keys and tensors, every value a tensor, no key but a parameter) by the tensors' versions and shapes
    only (``_StateLayout``): each write below is found there as a full read finds it (an in-place write, ``set_`` to
    another size, a moment rebound at a freed one's address, a new key, a non-tensor value, a key that is no
    parameter, a parameter's state dropped while another key comes in, the state dict replaced, a key renamed, a
    learning rate, a group added, a parameter left out, two parameters' states swapped), and nothing
    when nothing changed."""
    from lightning_dp.validators.steered_settings import OptimizerState, _StateLayout

    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model[:2].parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    w, b = model[0].weight, model[0].bias

    def rebind() -> None:
        freed = id(opt.state[w]["exp_avg"])
        opt.state[w]["exp_avg"] = None
        made = [torch.zeros(8, 4) for _ in range(500)]
        opt.state[w]["exp_avg"] = next((t for t in made if id(t) == freed), made[0])

    def swap_in() -> None:
        del opt.state[b]
        opt.state["loss_scale"] = torch.ones(())

    def rename() -> None:  # the same tensors in the same order, one under another key
        held = opt.state[w]
        items = [("exp_avg_2" if k == "exp_avg" else k, v) for k, v in held.items()]
        held.clear()
        held.update(items)

    def move() -> None:  # the same dicts, each under the other parameter
        opt.state[w], opt.state[b] = opt.state[b], opt.state[w]

    writes = {"none": lambda: None, "in place": lambda: opt.state[w]["exp_avg"].add_(1.0),
              "set_": lambda: opt.state[w]["exp_avg"].set_(torch.zeros(3)), "rebound": rebind,
              "new key": lambda: opt.state[w].__setitem__("kept", torch.ones(2)),
              "value": lambda: opt.state[w].__setitem__("scale", 2.0),
              "not a parameter": lambda: opt.state.__setitem__("loss_scale", 1.0), "swapped in": swap_in,
              "dict replaced": lambda: opt.state.__setitem__(w, dict(opt.state[w])), "renamed": rename,
              "lr": lambda: opt.param_groups[0].update(lr=1), "moved": move,
              "group": lambda: opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5}),
              "left out": lambda: opt.param_groups[0]["params"].pop(1)}
    for name, write in writes.items():
        state = {p: dict(s) for p, s in opt.state.items()}
        groups = [dict(g, params=list(g["params"])) for g in opt.param_groups]
        OptimizerState(opt)  # a full read: its layout kept
        rows = OptimizerState(opt)
        assert _StateLayout.read(opt) is not None, name  # read by versions and shapes
        _StateLayout._kept.clear()
        full = OptimizerState(opt)  # read in full
        assert rows.rows == full.rows and rows.entries() == full.entries(), name
        write()
        again = OptimizerState(opt)
        _StateLayout._kept.clear()
        expected = full.changed(OptimizerState(opt))
        assert rows.changed(again) == expected, name
        assert bool(expected) == (name not in ("none", "dict replaced")), name
        opt.state.clear()
        opt.state.update(state)
        opt.param_groups[:] = groups
