"""Dispatching fit onto backends: the connector, launch environments, launchers and strategies."""
