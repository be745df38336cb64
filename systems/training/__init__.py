"""Lesson 9, training: TensorFlow's side (variables, GradientTape, towers, MirroredStrategy), the course step's oracle."""
