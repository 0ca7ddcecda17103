"""Quickstart: train a small MLP on scikit-learn's bundled digits data set (8x8 images, 10 classes).

Run:  python examples/quickstart.py
Prints the test accuracy (about 0.97) and exits with status 1 if it is below 0.95.
"""
from __future__ import annotations

import sys

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn

import easyfit

TARGET_ACCURACY = 0.95


def load_data():
    """Standardized digits, split 75 / 25 into train and test (stratified, seeded)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), scaler.transform(x_test), y_train, y_test


def main() -> int:
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))

    model = easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"])
    history = model.fit(x_train, y_train, epochs=25, batch_size=32, validation_split=0.1, verbose=2)
    scores = model.evaluate(x_test, y_test, verbose=0, return_dict=True)

    print(f"final val_accuracy: {history.history['val_accuracy'][-1]:.4f}")
    print(f"test accuracy: {scores['accuracy']:.4f}")
    if scores["accuracy"] < TARGET_ACCURACY:
        print(f"test accuracy is below {TARGET_ACCURACY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
