"""The test suite, one package per folder: test modules import what they share by package path
(`from tests.helpers import random_inputs`, `from tests.runtime.test_known_models import
fla_naive`), and pytest imports each test module under its package name, so two folders may hold
modules of the same name."""
