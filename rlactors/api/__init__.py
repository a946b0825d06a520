"""What a program and its actors use: the actor base class, handles, the cluster connection,
collective groups, the stacks report, how a running cluster is found."""
