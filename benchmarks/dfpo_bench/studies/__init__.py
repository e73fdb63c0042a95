"""The studies: pre-registered comparisons of the objectives, their pilots, plans and analyses."""
