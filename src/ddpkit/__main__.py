from ddpkit.cli import program

program()
