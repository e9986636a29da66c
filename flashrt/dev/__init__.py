"""Developer entry points: the demo (`flashrt demo`) and the default model's training script
(`python -m flashrt.dev.train`).

Rule: outside the runtime's import graph. dev/ may import any public face; nothing in the
package imports dev/ except the command line (cli.py), lazily.
"""
