"""The tuner's search loop, search spaces and runners (local, Ray, replay). Not built yet: see the
project's issues."""
