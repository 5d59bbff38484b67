"""Measurements on this machine that passes use: costs of rounds and steps, attention recall, host reads."""
