"""The example run configs, installed as package data: `moepar train tiny` runs tiny.toml."""
