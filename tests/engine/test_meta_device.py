"""`backward_group` on a model whose weights were never materialised (meta device): a ValueError naming the
parameter, before any compute, instead of an error from deep inside the first forward."""

from __future__ import annotations

import pytest
import torch

from longstraw import Group, backward_group, load_model


@pytest.mark.parametrize("plan", ["standard", "detach", "exact"])
def test_a_model_on_the_meta_device_is_refused_naming_the_parameter(plan):
    model = load_model("tiny-llama").to("meta")
    group = Group(torch.tensor([1, 2, 3]), [torch.tensor([4, 5]), torch.tensor([6])], torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match=r"parameter model\.embed_tokens\.weight is on the meta device \(a shape with "
                                         r"no data\): load or initialise the model's weights"):
        backward_group(model, group, plan=plan)
