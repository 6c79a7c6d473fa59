"""The basement: errors and exit codes, logging, input rules, ports, network interfaces, test faults.

Imported by every layer; imports no other ddpkit package and no torch.
"""
