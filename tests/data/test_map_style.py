"""Map-style data by protocol: a Hugging Face `datasets.Dataset` (formatted or not), a list of sample dicts and any
object with `__len__` and `__getitem__` are sampled and batched by easyfit as a torch Dataset is, one `__getitems__`
call per batch where the data has it; `collate_fn` collates them; each trains what a plain loop trains on the same
batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easyfit
from easyfit.data.map_style import collate_samples, is_map_style

datasets = pytest.importorskip("datasets")

BATCH, EPOCHS, LR = 16, 2, 0.1


def data(samples: int = 64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def plain_loop(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], dict]:
    """SGD over the batches in order, as easyfit takes them without shuffling: (epoch mean losses, weights)."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for _ in range(EPOCHS):
        total = 0.0
        for start in range(0, len(x), BATCH):
            loss = nn.functional.cross_entropy(net(x[start:start + BATCH]), y[start:start + BATCH])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(x[start:start + BATCH])
        losses.append(total / len(x))
    return losses, net.state_dict()


def fitted(data, **kwargs) -> easyfit.Model:
    torch.manual_seed(0)
    model = easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd", lr=LR)
    model.history_ = model.fit(data, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs)
    return model


def assert_like_plain_loop(model: easyfit.Model, x, y) -> None:
    losses, weights = plain_loop(x, y)
    assert model.history_.history["loss"] == pytest.approx(losses, abs=1e-5)
    for name, value in model.net.state_dict().items():
        torch.testing.assert_close(value, weights[name], atol=1e-5, rtol=0)


def hf_dataset(label_key: str = "label", form: str | None = "torch"):
    x, y = data()
    dataset = datasets.Dataset.from_dict({"x": x.tolist(), label_key: y.tolist()})
    return dataset.with_format(form) if form else dataset


@pytest.mark.parametrize("label_key", ["label", "labels"])
@pytest.mark.parametrize("form", ["torch", None, "numpy"])
def test_a_hugging_face_dataset_trains_like_a_plain_loop_on_its_batches(label_key, form):
    model = fitted(hf_dataset(label_key, form))
    assert model.history_.params["steps_per_epoch"] == 4   # batches of 16, not rows
    assert_like_plain_loop(model, *data())


def test_a_list_of_sample_dicts_trains_like_a_plain_loop():
    x, y = data()
    assert_like_plain_loop(fitted([{"x": row, "label": label} for row, label in zip(x, y)]), x, y)
    assert_like_plain_loop(fitted([{"x": row.tolist(), "y": int(label)} for row, label in zip(x, y)]), x, y)


def test_a_list_of_batch_dicts_stays_a_list_of_batches():
    x, y = data()
    batches = [{"x": x[i:i + BATCH], "y": y[i:i + BATCH]} for i in range(0, 64, BATCH)]
    assert not is_map_style(batches)
    assert_like_plain_loop(fitted(batches), x, y)


class Tagger(nn.Module):
    """One class score per token: (batch, classes, tokens), as cross_entropy takes it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(16, 3)

    def forward(self, x):
        return self.embedding(x).transpose(1, 2)


def test_a_list_of_per_sample_token_dicts_is_explained_and_trains_with_a_collate_fn():
    """Dicts of 1-D tensors of one length read as batches are said to be so, with the way to batch them as samples."""
    generator = torch.Generator().manual_seed(0)
    ids, tags = torch.randint(0, 16, (32, 6), generator=generator), torch.randint(0, 3, (32, 6), generator=generator)
    rows = [{"x": x, "y": y} for x, y in zip(ids, tags)]
    with pytest.warns(UserWarning, match=r"list of 32 dicts is read as a list of batches: each dict one batch of 6 "
                                         r"samples.*collate_fn=torch.utils.data.default_collate.*torch Dataset"), \
            pytest.raises(IndexError):   # the net, given 1-D inputs
        easyfit.Model(Tagger(), "cross_entropy", "sgd", lr=LR).fit(rows, epochs=1, verbose=0)
    model = easyfit.Model(Tagger(), "cross_entropy", "sgd", lr=LR)
    model.fit(rows, batch_size=8, epochs=1, shuffle=False, verbose=0, collate_fn=torch.utils.data.default_collate)
    plain = Tagger()
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    for x, y in zip(ids.split(8), tags.split(8)):
        optimizer.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(model.net.embedding.weight, plain.embedding.weight, atol=1e-6, rtol=0)


class Rows:
    """Any object with a length and an index; `__getitems__` fetches a batch in one call (Hugging Face's way)."""

    def __init__(self, x, y):
        self.x, self.y, self.batch_calls, self.row_calls = x, y, 0, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.row_calls += 1
        return {"x": self.x[index], "target": self.y[index]}

    def __getitems__(self, indices):
        self.batch_calls += 1
        return [{"x": self.x[i], "target": self.y[i]} for i in indices]


def test_getitems_fetches_each_batch_in_one_call():
    x, y = data()
    rows = Rows(x, y)
    model = fitted(rows)
    assert_like_plain_loop(model, x, y)
    assert (rows.batch_calls, rows.row_calls) == (EPOCHS * 4, 0)


def test_evaluate_and_predict_take_every_sample_once_in_order():
    x, y = data(70)   # a short last batch
    dataset = datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).with_format("torch")
    model = fitted(dataset)
    with torch.no_grad():
        expected = model.net(x)
    torch.testing.assert_close(model.predict(dataset, batch_size=16), expected)
    loss = model.evaluate(dataset, batch_size=16, verbose=0)
    assert loss == pytest.approx(float(nn.functional.cross_entropy(expected, y)), abs=1e-5)


def test_validation_split_of_a_hugging_face_dataset_holds_out_its_last_rows():
    history = fitted(hf_dataset(), validation_split=0.25).history_
    assert history.params["steps_per_epoch"] == 3 and len(history.history["val_loss"]) == EPOCHS


def padded(samples: list[dict]) -> dict:
    """A padding collator: each batch as long as its longest sequence."""
    longest = max(len(sample["tokens"]) for sample in samples)
    tokens = torch.zeros(len(samples), longest)
    for row, sample in enumerate(samples):
        tokens[row, :len(sample["tokens"])] = torch.as_tensor(sample["tokens"], dtype=torch.float32)
    return {"x": tokens[:, :4], "label": torch.tensor([sample["label"] for sample in samples])}


def test_collate_fn_collates_the_samples_of_variable_length():
    x, y = data()
    lengths = torch.randint(4, 9, (64,), generator=torch.Generator().manual_seed(1))
    rows = [{"tokens": x[i].tolist() + [1.0] * (int(lengths[i]) - 4), "label": int(y[i])} for i in range(64)]
    dataset = datasets.Dataset.from_list(rows)
    with pytest.raises(ValueError, match="different lengths.*collate_fn"):
        fitted(dataset)
    assert_like_plain_loop(fitted(dataset, collate_fn=padded), x, y)
    assert fitted(dataset, collate_fn=padded).predict(dataset, collate_fn=padded).shape == (64, 2)


def test_collate_fn_for_data_batched_elsewhere_is_refused_before_training():
    x, y = data()
    model = easyfit.Model(nn.Linear(4, 2))
    for data_, y_ in ((x, y), (DataLoader(TensorDataset(x, y), batch_size=8), None), ([(x, y)], None)):
        with pytest.raises(ValueError, match="collate_fn collates the samples of data easyfit batches itself"):
            model.fit(data_, y_, collate_fn=collate_samples, verbose=0)


def test_unformatted_rows_become_tensors():
    batch = collate_samples([{"x": [1.0, 2.0], "label": 0, "name": "a"}, {"x": [3.0, 4.0], "label": 1, "name": "b"}])
    torch.testing.assert_close(batch["x"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert batch["label"].tolist() == [0, 1] and batch["name"] == ["a", "b"]


def test_an_iterable_hugging_face_dataset_is_batched():
    x, y = data()
    stream = hf_dataset().to_iterable_dataset()
    history = fitted(stream).history_
    assert history.params["steps_per_epoch"] is None
    assert history.history["loss"] == pytest.approx(plain_loop(x, y)[0], abs=1e-5)


def test_what_is_not_map_style():
    x, y = data()
    for value in (x, x.numpy(), {"x": x}, "path", [(x, y)], DataLoader(TensorDataset(x, y)), [], np.zeros(3)):
        assert not is_map_style(value)
    for value in (hf_dataset(), TensorDataset(x, y), [{"x": x[0], "label": 1}], Rows(x, y)):
        assert is_map_style(value)


def test_a_collator_returning_another_mapping_trains_as_a_dict():
    """transformers' collators return a BatchEncoding, a mapping that is not a dict."""
    from collections import UserDict
    x, y = data()
    dataset = datasets.Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()}).with_format("torch")
    assert_like_plain_loop(fitted(dataset, collate_fn=lambda rows: UserDict(collate_samples(rows))), x, y)


def test_the_splits_of_a_data_set_are_refused_naming_one():
    splits = datasets.DatasetDict({"train": hf_dataset(), "test": hf_dataset()})
    with pytest.raises(ValueError, match=r"DatasetDict of the splits 'train', 'test'; pass one split, e.g. "
                                         r"fit\(data\['train'\]\)"):
        easyfit.Model(nn.Linear(4, 2)).fit(splits, verbose=0)
