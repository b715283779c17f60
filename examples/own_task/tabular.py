"""scikit-learn's breast-cancer data (ships with scikit-learn) and a small MLP, as a task."""

from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn

from tasks.custom import tensor_task


def make_task(cfg):
    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    mean, std = x_train.mean(0), x_train.std(0)
    return tensor_task((x_train - mean) / std, y_train, (x_test - mean) / std, y_test, build_model=mlp)


def mlp():
    return nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2))
