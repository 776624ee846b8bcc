"""One pass per parallel form, one file each; `moepass/pipeline.py` lists them in `REWRITES`."""
