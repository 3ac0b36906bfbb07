# Makes conf/ importable as grpo.conf (src/grpo/conf links here), which Hydra needs to find the configs inside
# an installed package (pkg://grpo/conf): grpo-train runs outside the checkout with these very files.
