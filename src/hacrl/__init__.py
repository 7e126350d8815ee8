"""hacrl: post-train a pool of heterogeneous LLMs together with RL on verifiable rewards."""

__version__ = "0.1.0"
