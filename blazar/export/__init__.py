"""Blazar's manifests translated for other platforms (`blazar export`): pure
translations, each taking validated resources and returning objects and the list of
what did not translate. Reading files and printing belong to `blazar.cli.export`."""
