"""One pass per parallel form; importing this package registers each into `pipeline.REWRITES`."""

from moepass.rewrite import ep  # noqa: F401  (REWRITES["ep"])
