# Compiled as it is, with no declarations of its own (see joblock/_core.py): the clients'
# calls that a lone caller makes per lock then run without the interpreter.
